"""LoRA as a weight method: the base layer's product plus each token's adapter delta.

`LoRAMethod` wraps a layer's own weight method (dense, GPTQ/AWQ, FP8, ...) and adds
x @ A[slot].T @ B[slot].T for every token whose request runs an adapter. The adapters live
in `max_loras` fixed slots per layer: A [slots, shards * max_rank, in] and B
[slots, out, shards * max_rank], zero-padded past each adapter's rank. A fused layer
(q/k/v, gate/up) keeps each shard's A in its own band of rows and its B block-diagonal,
so one shrink and one expand serve the fused output; the adapter's scale is folded into
B. Under tensor parallelism the slots are cut like the layer: B by the rank's output rows
(column-parallel), A by its input columns (row-parallel, where the delta is a partial sum
that the layer's all-reduce adds up with the base product).

Which slot each token uses is one shared `LoRABatch` (a per-token slot index and the same
tokens grouped by slot, in persistent device buffers): the runner fills it before each
step, the layers only read it, so CUDA graphs replay with new adapters in place. In
batch-invariant mode the delta takes the torch path over fixed-tile products, so that a
request's bits do not depend on its batch with LoRA either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm import batch_invariant
from pagedllm.model_executor.layers.weight_method import WeightMethod

if TYPE_CHECKING:
    from pagedllm.model_executor.layers.linear import LinearBase


# Token rows per tile in steps of up to 256 rows (decodes), and in larger ones (prefill
# chunks, decodes mixed with a prompt's chunk). Module settings so that
# benchmarks/lora_kernel_bench.py can sweep them; read when a LoRABatch is bound, so they
# must not change while an engine runs (its CUDA graphs keep the tiles they were captured
# with).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 64


def lora_block_m(num_rows: int) -> int:
    """Token rows per tile of the LoRA kernels for a step of `num_rows` rows (small tiles
    for decode steps, larger ones for prefills); the tile table is cut with it."""
    return DECODE_BLOCK_M if num_rows <= 256 else PREFILL_BLOCK_M


class LoRABatch:
    """Per-token adapter slots of the current step, in one persistent int32 device buffer
    (token slot | tokens grouped by slot | tokens per slot | first index per slot | tile
    table: slot, then tile index within the slot, of each token tile).

    The kernels' grid has one row of programs per entry of the tile table, which holds
    only the tiles some slot's tokens fill (at most ceil(rows / BM) + slots of them): a
    step where one adapter of four is in use, or none, launches about a quarter of the
    programs a (token tiles x slots) grid would, most of which would find no token.

    `active` False: no token of the step has an adapter (eager steps then skip LoRA)."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device):
        self.num_slots = num_slots
        self.max_tokens = t = -(-max_tokens // 16) * 16
        self.device = device
        s = -(-num_slots // 16) * 16
        self.max_tiles = mt = -(-(t // 16 + num_slots) // 16) * 16
        self._off = (0, t, 2 * t, 2 * t + s, 2 * t + 2 * s, 2 * t + 2 * s + mt)
        self.buf = torch.zeros(2 * t + 2 * s + 2 * mt, dtype=torch.int32, device=device)
        self.buf[: t] = -1
        self.buf[self._off[4] :] = -1
        self.use_triton = device.type == "cuda"
        self.active = False
        self.bind(0)

    def num_tiles(self, num_rows: int) -> int:
        """Entries of the tile table a step of `num_rows` rows launches."""
        return -(-num_rows // lora_block_m(num_rows)) + self.num_slots

    def bind(self, num_tokens: int) -> None:
        """Views of the buffer for a step of `num_tokens` rows (a captured graph's size)."""
        o, t = self._off, num_tokens
        self.block_m = lora_block_m(t)
        nt = self.num_tiles(t)
        self.token_slot = self.buf[o[0] : o[0] + t]
        self.sorted_tokens = self.buf[o[1] : o[1] + t]
        self.counts = self.buf[o[2] : o[2] + self.num_slots]
        self.starts = self.buf[o[3] : o[3] + self.num_slots]
        self.tile_slot = self.buf[o[4] : o[4] + nt]
        self.tile_m = self.buf[o[5] : o[5] + nt]

    def host_arrays(self, token_slots: np.ndarray, num_rows: int) -> np.ndarray:
        """The buffer's contents for a step whose rows (padded to `num_rows`) use these
        slots (-1: the base model)."""
        n = len(token_slots)
        if num_rows > self.max_tokens:
            raise RuntimeError(f"a step of {num_rows} tokens exceeds the LoRA buffers ({self.max_tokens})")
        o = self._off
        host = np.zeros(len(self.buf), dtype=np.int32)
        host[o[0] : o[0] + self.max_tokens] = -1
        host[o[0] : o[0] + n] = token_slots
        listed = np.flatnonzero(token_slots >= 0)
        order = listed[np.argsort(token_slots[listed], kind="stable")]
        host[o[1] : o[1] + len(order)] = order
        counts = np.bincount(token_slots[listed], minlength=self.num_slots)[: self.num_slots]
        host[o[2] : o[2] + self.num_slots] = counts
        starts = np.zeros(self.num_slots, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        host[o[3] : o[3] + self.num_slots] = starts
        bm = lora_block_m(num_rows)
        tiles = -(-counts // bm)  # per slot
        total = int(tiles.sum())
        host[o[4] :] = -1
        host[o[4] : o[4] + total] = np.repeat(np.arange(self.num_slots), tiles)
        first = np.zeros(self.num_slots, dtype=np.int64)
        np.cumsum(tiles[:-1], out=first[1:])
        host[o[5] : o[5] + total] = np.arange(total) - np.repeat(first, tiles)
        return host

    def set(self, token_slots: np.ndarray, num_rows: int) -> None:
        """Fill the buffer for the next step without waiting for the device: a fresh
        pinned copy, queued behind the steps still running (which read the old values)."""
        host = torch.from_numpy(self.host_arrays(token_slots, num_rows))
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.buf.copy_(host, non_blocking=True)
        self.bind(num_rows)
        self.active = bool((token_slots >= 0).any())


def lora_delta_torch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     token_slot: torch.Tensor) -> torch.Tensor:
    """Every token's x @ A[slot].T @ B[slot].T (zero for slot -1), with no per-adapter loop
    and no data-dependent shapes: all slots' shrink, masked to each token's own slot, then
    one expand over the slots' concatenated ranks. The reference the kernels are tested
    against, the CPU path, and the batch-invariant path (its products are
    batch_invariant.linear: fixed tiles in that mode)."""
    slots, r, k = a.shape
    h = batch_invariant.linear(x, a.reshape(slots * r, k))  # [T, slots * r]
    own = token_slot.unsqueeze(1) == torch.arange(slots, device=x.device, dtype=token_slot.dtype)
    h = (h.view(-1, slots, r) * own.unsqueeze(-1).to(h.dtype)).reshape(-1, slots * r)
    return batch_invariant.linear(h, b.permute(1, 0, 2).reshape(b.shape[1], slots * r))


class LoRAMethod(WeightMethod):
    """A layer's weight method with LoRA slots added (see the module docstring). Loading
    and the base product stay with the wrapped method."""

    name = "lora"

    def __init__(self, inner: WeightMethod, layer: LinearBase, batch: LoRABatch, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.inner = inner
        self.batch = batch
        self.max_rank = max_rank
        self.shard_names = list(layer.layout.shards)
        width = len(self.shard_names) * max_rank
        slots = batch.num_slots
        # Buffers, not parameters: they are not checkpoint weights (weight_bytes skips them).
        layer.register_buffer("lora_a", torch.zeros(slots, width, layer.layout.in_features,
                                                     dtype=dtype, device=device), persistent=False)
        layer.register_buffer("lora_b", torch.zeros(slots, layer.layout.out_features, width,
                                                    dtype=dtype, device=device), persistent=False)

    def __getattr__(self, name):  # anything else is the wrapped method's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def describe(self, layer: LinearBase) -> str:
        return f"{self.inner.describe(layer)} + LoRA (slots {self.batch.num_slots}, rank {self.max_rank})"

    def dequantized_weight(self, layer: LinearBase, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.inner.dequantized_weight(layer, dtype)

    def missing(self, layer: LinearBase) -> list[str]:
        return self.inner.missing(layer)

    def finish(self, layer: LinearBase) -> None:
        self.inner.finish(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.inner.apply(layer, x, bias)
        batch = self.batch
        if not batch.active:
            return y
        if batch.use_triton and not batch_invariant.is_enabled():
            from pagedllm.model_executor.lora.triton_ops import lora_expand, lora_shrink

            return lora_expand(lora_shrink(x, layer.lora_a, batch), layer.lora_b, y, batch)
        return y + lora_delta_torch(x, layer.lora_a, layer.lora_b, batch.token_slot).to(y.dtype)

    # ------------------------------------------------------------------ slots
    @torch.no_grad()
    def slot_tensors(self, layer: LinearBase,
                     pieces: dict[str | None, tuple[torch.Tensor, torch.Tensor, float]],
                     pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One adapter's (A, B) for this layer as one slot holds them, on the CPU (pinned
        for a fast copy when `pin`), from per shard the full checkpoint (A [r, full_in],
        B [full_out, r], scale); shards it does not adapt stay zero. Each rank keeps its
        block, as the layer does."""
        lay, r_max = layer.layout, self.max_rank
        a = torch.zeros(layer.lora_a.shape[1:], dtype=layer.lora_a.dtype)
        b = torch.zeros(layer.lora_b.shape[1:], dtype=layer.lora_b.dtype)
        for i, shard in enumerate(self.shard_names):
            if shard not in pieces:
                continue
            a_full, b_full, scale = pieces[shard]
            _, src, n = lay.parts[shard]
            start, _ = lay.shards[shard]
            r = a_full.shape[0]  # shapes checked by the caller (worker/lora_manager.py)
            band = slice(i * r_max, i * r_max + r)
            a[band] = a_full[:, lay.in_start : lay.in_start + lay.in_features].to(a.dtype)
            b[start : start + n, band] = (b_full[src : src + n].float() * scale).to(b.dtype)
        return (a.pin_memory(), b.pin_memory()) if pin else (a, b)

    @torch.no_grad()
    def set_slot(self, layer: LinearBase, slot: int,
                 tensors: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Fill `slot` with `slot_tensors`' output (None: an adapter that leaves this layer
        alone). Queued behind the steps still running, which may read the old contents."""
        if tensors is None:
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            return
        layer.lora_a[slot].copy_(tensors[0], non_blocking=True)
        layer.lora_b[slot].copy_(tensors[1], non_blocking=True)
