"""What attention needs to know about a flat batch, beyond the tokens themselves.

Built by the model runner, read by the attention backend; models only pass it through.
Decode tokens (one new token per request) come first in the batch so that all of them can
be served by one batched kernel call; prefill chunks follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    q_start: int  # row of its first token in the flat batch
    q_len: int  # tokens computed this step
    ctx_len: int  # tokens in the cache after this step (cached prefix + q_len)
    block_table: torch.Tensor  # [num_blocks_for_ctx] int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every token in the batch
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor | None  # [num_decode] int64
    max_decode_context: int
    prefills: list[PrefillSeq]
