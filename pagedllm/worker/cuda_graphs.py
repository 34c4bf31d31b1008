"""CUDA graphs for decode steps: one captured forward (+ logits) per batch size.

A decode step of a small model is hundreds of tiny kernel launches whose Python and
launch overhead exceeds the GPU work; replaying a graph issues them all at once. Inputs
live in one persistent int32 device buffer (token ids, positions, slots, context lengths,
block tables) that a single host-to-device copy refreshes before each replay. A batch is
padded up to the nearest captured size; padding rows write no KV (slot -1) and attend to
one key of block 0, and their logits are ignored.

With LoRA the graphs hold the adapter kernels too: they read each row's slot from the
LoRABatch's persistent buffer, refreshed before each replay (padding rows use none).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, kv_caches, device: torch.device, max_batch: int, max_blocks: int,
                 lora=None):
        self.lora = lora  # a LoRABatch, or None
        self.sizes = capture_sizes(max_batch)
        self.max_batch = b = self.sizes[-1]
        self.width = w = max_blocks
        # Field offsets in the packed buffer: ids, positions, slots, q_start, q_len, ctx, tables;
        # each 64-byte aligned so every captured size uses the same kernel specialisation.
        stride = -(-b // 16) * 16
        self._off = {name: i * stride for i, name in enumerate(("ids", "pos", "slots", "q_start", "q_len", "ctx"))}
        self._off["tables"] = 6 * stride
        n = 6 * stride + b * w
        # Two pinned host buffers used in turn: with async scheduling the next step is laid
        # out while the previous copy may still be queued, so a buffer is only rewritten
        # once the event recorded after its own copy has passed.
        self._hosts = [torch.zeros(n, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._copied = [None, None]
        self._turn = 0
        self.dev = torch.zeros(n, dtype=torch.int32, device=device)
        for host_t in self._hosts:
            h = host_t.numpy()
            h[self._off["q_start"] : self._off["q_start"] + b] = np.arange(b)
            h[self._off["q_len"] : self._off["q_len"] + b] = 1
            self._reset_padding(h, 0)
        self.dev.copy_(self._hosts[0])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            meta = self._meta(size)
            ids, pos = self._field("ids", size), self._field("pos", size)
            if lora is not None:  # captured with the adapter kernels in (no row uses one yet)
                lora.bind(size)
                lora.active = True
            for _ in range(2):  # compile kernels and settle allocations outside the capture
                model.compute_logits(model(ids, pos, kv_caches, meta))
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[size] = model.compute_logits(model(ids, pos, kv_caches, meta))
            pool = g.pool()
            self.graphs[size] = g
        torch.cuda.synchronize(device)
        if lora is not None:
            lora.active = False

    def _field(self, name: str, size: int, buf: torch.Tensor | np.ndarray | None = None):
        buf = self.dev if buf is None else buf
        start = self._off[name]
        return buf[start : start + size]

    def _tables(self, buf=None):
        buf = self.dev if buf is None else buf
        return buf[self._off["tables"] :].reshape(self.max_batch, self.width)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._field("slots", size), num_decode=size,
            block_tables=self._tables()[:size], q_start=self._field("q_start", size),
            q_len=self._field("q_len", size), ctx_len=self._field("ctx", size),
        )

    def _reset_padding(self, h: np.ndarray, start: int) -> None:
        for name, value in (("ids", 0), ("pos", 0), ("slots", -1), ("ctx", 1)):
            off = self._off[name]
            h[off + start : off + self.max_batch] = value

    def run(self, arrays: dict[str, np.ndarray],
            before_replay: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Replay the graph for a decode-only step; None if it does not fit one.
        `before_replay` may still change the input ids on the device (tokens that the
        previous step sampled and the host has not read yet)."""
        n = len(arrays["ids"])
        tables = arrays["tables"]
        if n > self.max_batch or tables.shape[1] > self.width:
            return None
        size = next(s for s in self.sizes if s >= n)
        self._turn ^= 1
        host_t = self._hosts[self._turn]
        h = host_t.numpy()
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        for name, key in (("ids", "ids"), ("pos", "positions"), ("slots", "slots"), ("ctx", "ctx_len")):
            off = self._off[name]
            h[off : off + n] = arrays[key]
        self._reset_padding(h, n)
        self._tables(h)[:n, : tables.shape[1]] = tables
        self.dev.copy_(host_t, non_blocking=True)
        done = self._copied[self._turn] = self._copied[self._turn] or torch.cuda.Event()
        done.record()
        if before_replay is not None:
            before_replay(self._field("ids", n))
        if self.lora is not None:
            self.lora.set(arrays["lora_slots"], size)
        self.graphs[size].replay()
        return self.logits[size][:n]
