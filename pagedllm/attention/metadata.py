"""What attention needs to know about a flat batch, beyond the tokens themselves.

Built by the model runner, read by the attention backend; models only pass it through.
The batch is a list of sequences, each contributing `q_len` consecutive rows (tokens
computed this step) and attending to `ctx_len` cached tokens (its earlier tokens plus
these). Single-token sequences (decodes) come first so that one batched kernel launch
serves all of them; multi-token chunks (prefills) follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A decode batch with one long context among short ones (a 32k document's answer beside 64
# chat streams) waits on that one sequence: unsplit, one program a head walks its every key
# while the rest of the GPU idles (H200, Llama-2-7B shape, 64 streams and one 32k sequence:
# 37 ms a step against 8.3 without it). Such a batch splits every sequence's keys over the
# Triton backend's MAX_KV_SPLITS programs whatever its size; the short sequences' spare
# splits return at once. Long: LONG_DECODE_KEYS keys at least, and LONG_DECODE_SHARE
# times the batch's mean context.
LONG_DECODE_KEYS = 4096
LONG_DECODE_SHARE = 4


def long_decode(ctx_lens: np.ndarray) -> bool:
    """Whether a decode batch of these context lengths has a long one among short ones."""
    if len(ctx_lens) == 0:
        return False
    longest = int(ctx_lens.max())
    return longest >= LONG_DECODE_KEYS and longest * len(ctx_lens) >= LONG_DECODE_SHARE * int(ctx_lens.sum())


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every row; -1 = write nothing (padding)
    num_decode: int  # the first num_decode sequences have q_len == 1
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    q_start: torch.Tensor  # [S] int32: first row of each sequence
    q_len: torch.Tensor  # [S] int32
    ctx_len: torch.Tensor  # [S] int32
    # Prefill work split for kernels: (sequence index, first query index) per query tile.
    prefill_tiles: torch.Tensor | None = None  # [2, >= num_prefill_tiles] int32
    num_prefill_tiles: int = 0
    prefill_tile_q: int = 0  # queries per tile the tiles were cut for
    # Tiles that may hold queries where a captured launch carries spare ones (MixedGraphs):
    # what a kernel sizes its key splits by; 0: num_prefill_tiles.
    prefill_busy_tiles: int = 0
    # The decodes include one whose context dwarfs the others' (attention.long_decode): a
    # launch splits its keys however many sequences decode (a captured graph's variant
    # for such steps). Eager launches decide from host_ctx_len themselves.
    decode_long: bool = False
    # The rows whose outputs the step reads (its sampled rows), when fewer than all: the
    # model may then run its last layer's MLP on these alone and return only their hidden
    # states, in this order (a 32k prompt needs one row of the last layer's MLP, not 32k).
    keep_rows: torch.Tensor | None = None
    # With keep_rows, the kept rows alone as decodes (one query each, its context up to
    # and including its own position, its keys already in the pages): a causal last layer
    # writes every row's keys and values and attends for these rows only. None: the
    # model's attention runs every row (a backend without write_kv, batch-invariant mode).
    keep_meta: AttentionMetadata | None = None
    # Host copies, for backends that loop over sequences in Python.
    host_q_start: np.ndarray | None = None
    host_q_len: np.ndarray | None = None
    host_ctx_len: np.ndarray | None = None
    host_block_tables: np.ndarray | None = None  # [S, max_blocks], as block_tables

    @property
    def num_seqs(self) -> int:
        return int(self.block_tables.shape[0])
