"""The GPTQ/AWQ weight method: a linear layer's packed integer tensors are its weights.

The packed tensors are parameters (int32 `qweight`/`qzeros`, fp16 `scales`), so the
engine's weight memory counts what really sits in memory. How they turn into a product
depends on the device:

- CUDA: a Triton kernel reads the packed words and dequantizes inside the GEMM, so the
  weights stay 4-bit in GPU memory (triton_w4a16.py). At load, qweight is re-packed once
  into the kernel's tiled row order (packing.tile_rows), still 4 bits a value.
- CPU: one dequantized float copy per layer, built once after loading and kept outside
  the parameters. CPU serving is the correctness path; a dequantize-per-call would be
  many times slower for no memory benefit that matters there.

Every checkpoint layout (GPTQ v1/v2, AWQ GEMM/GEMV) is converted at load into one internal
layout (packing.py), which is also what the GGUF-packed method fills (gguf.py).

Under tensor parallelism the layer's layout (layers/linear.py) says which block a rank
keeps. Column-parallel: output features, which are whole columns of qweight and scales
and whole packed words of qzeros, so the slices must start and end on a word.
Row-parallel: input features, whole packed rows of qweight and whole groups of
scales/zeros. Act-order checkpoints scatter the groups over the input, so there a rank
keeps the whole (small) group table and a group index per row (`groups`).
"""

from __future__ import annotations

import importlib.util
import logging
import math
from typing import TYPE_CHECKING

import torch

from pagedllm import batch_invariant
from pagedllm.distributed import get_tp_world_size
from pagedllm.model_executor.layers.quantization.config import QuantConfig
from pagedllm.model_executor.layers.quantization.packing import (
    awq_gemv_to_internal,
    awq_to_internal,
    dequantize,
    pack_rows,
    tile_rows,
    unpack_rows,
)
from pagedllm.model_executor.layers.sharding import check_shape, copy_block, read_block
from pagedllm.model_executor.layers.weight_method import (
    DenseMethod,
    WeightMethod,
    frozen_param,
    piece,
)

if TYPE_CHECKING:
    from pagedllm.model_executor.layers.linear import LinearBase

logger = logging.getLogger(__name__)

PACKED_TENSORS = ("qweight", "qzeros", "scales")


class PackedMethod(WeightMethod):
    """GPTQ (v1, v2) and AWQ (GEMM, GEMV) checkpoints, kept packed in the internal layout.

    A layer the checkpoint left in float (AWQ `modules_to_not_convert`: every shard
    arrives as a `.weight`) becomes a dense layer when loading finishes."""

    accepts_zero_bias = True

    def __init__(self, quant: QuantConfig):
        self.quant = quant
        self.name = quant.method
        self.dtype = torch.get_default_dtype()  # the activations' dtype (set by the loader)
        self._loaded: set[tuple[str, str | None]] = set()
        self._g_idx: dict[str | None, torch.Tensor] = {}
        self._float_rows: dict[str | None, torch.Tensor] = {}
        self._dequantized: torch.Tensor | None = None  # CPU cache, deliberately not a parameter
        self.tile_k: int | None = None  # set when qweight is in the CUDA kernel's tiled layout

    # ------------------------------------------------------------------ create
    def create(self, layer: LinearBase) -> None:
        quant, layout, world = self.quant, layer.layout, get_tp_world_size()
        pack = quant.pack_factor
        for size, src, n in layout.parts.values():
            if size % pack or n % pack or src % pack:
                raise ValueError(f"{quant.method} needs output sizes divisible by {pack}"
                                 + (f" on each of {world} ranks" if world > 1 else "") + f", got {size}"
                                 + (f" split into {n}" if n != size else ""))
        if layout.full_in % pack:
            raise ValueError(f"{quant.method} needs in_features divisible by {pack}, got {layout.full_in}")
        k, full_in = layout.in_features, layout.full_in
        if k % pack:
            raise ValueError(f"{quant.method} packs {pack} input features a word: each rank's input "
                             f"slice ({k} of {full_in}) must be a multiple of {pack}")
        full_group = quant.group_size_for(full_in)
        self.num_groups = math.ceil(full_in / full_group)  # rows of scales in the checkpoint
        # Act-order, row-parallel: groups are scattered over the inputs, every rank keeps them all.
        self.row_groups = layout.reduce and quant.desc_act and quant.group_size != -1
        if not layout.reduce or self.row_groups:
            self.group_size, self.group_rows = full_group, (0, self.num_groups)
        elif quant.group_size == -1:  # one group over all inputs: each rank has some of its rows
            self.group_size, self.group_rows = k, (0, 1)
        else:
            if k % full_group:
                raise ValueError(f"a row-parallel {quant.method} layer splits its input by whole groups: "
                                 f"{full_in} inputs in groups of {full_group} cannot be split over "
                                 f"{world} ranks")
            self.group_size, self.group_rows = full_group, (layout.in_start // full_group, k // full_group)
        groups, n = self.group_rows[1], layout.out_features
        layer.qweight = frozen_param(torch.empty(k // pack, n, dtype=torch.int32))
        layer.qzeros = frozen_param(torch.empty(groups, n // pack, dtype=torch.int32))
        layer.scales = frozen_param(torch.empty(groups, n, dtype=torch.float16))
        # Row i of qweight is input feature perm[i] (act-order checkpoints, sorted at load).
        layer.register_parameter("perm", None)
        # Group of each row, when a rank's rows are not whole groups in order (row_groups).
        layer.register_parameter("groups", None)
        # Set when the checkpoint stores this layer in float (AWQ modules_to_not_convert).
        layer.register_parameter("weight", None)

    def describe(self, layer: LinearBase) -> str:
        q = self.quant
        return (f"{q.method} {q.bits}-bit, group={q.group_size}, "
                f"act_order={layer.perm is not None or layer.groups is not None}")

    # ------------------------------------------------------------------ loading
    def load(self, layer: LinearBase, param_name: str, shard: str | None, tensor) -> None:
        layout = layer.layout
        full, src, n = layout.parts[shard]
        start = layout.shards[shard][0]
        pack = self.quant.pack_factor
        awq = self.quant.method == "awq"
        gemv = self.quant.checkpoint_format == "awq_gemv"
        k0, k, full_in = layout.in_start, layout.in_features, layout.full_in
        g0, ng = self.group_rows
        out_cols, word_cols = slice(src, src + n), slice(src // pack, (src + n) // pack)
        what = piece(param_name, shard)
        if param_name == "g_idx":
            check_shape(what, tensor, (full_in,))
            self._g_idx[shard] = read_block(tensor, slice(k0, k0 + k)).to(torch.long).cpu()
        elif param_name == "weight":
            check_shape(what, tensor, (full, full_in))
            self._float_rows[shard] = read_block(tensor, out_cols, slice(k0, k0 + k))
        elif gemv and param_name in PACKED_TENSORS:  # AWQ GEMV: transposed, [N, ...]
            groups = slice(g0, g0 + ng)
            if param_name == "qweight":
                check_shape(what, tensor, (full, full_in // pack))
                block = read_block(tensor, out_cols, slice(k0 // pack, (k0 + k) // pack))
                target = layer.qweight.data[:, start:start + n]
            else:
                padded = self._gemv_group_words()
                shape = (full, padded) if param_name == "qzeros" else (full, padded * pack)
                check_shape(what, tensor, shape)
                block = read_block(tensor, out_cols)
                target = (layer.qzeros.data[:, start // pack:(start + n) // pack] if param_name == "qzeros"
                          else layer.scales.data[:, start:start + n])
            copy_block(what, target, awq_gemv_to_internal(param_name, block, groups))
        elif param_name == "qweight":
            if awq:  # [K, N / 8], packed (interleaved) along the output
                check_shape(what, tensor, (full_in, full // pack))
                block = awq_to_internal("qweight", read_block(tensor, slice(k0, k0 + k), word_cols).to(torch.int32))
            else:  # [K / pack, N], packed along the input
                check_shape(what, tensor, (full_in // pack, full))
                block = read_block(tensor, slice(k0 // pack, (k0 + k) // pack), out_cols)
            copy_block(what, layer.qweight.data[:, start:start + n], block)
        elif param_name == "qzeros":
            check_shape(what, tensor, (self.num_groups, full // pack))
            block = read_block(tensor, slice(g0, g0 + ng), word_cols)
            if awq:
                block = awq_to_internal("qzeros", block.to(torch.int32))
            copy_block(what, layer.qzeros.data[:, start // pack:(start + n) // pack], block)
        elif param_name == "scales":
            check_shape(what, tensor, (self.num_groups, full))
            copy_block(what, layer.scales.data[:, start:start + n], read_block(tensor, slice(g0, g0 + ng), out_cols))
        else:
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in a {self.quant.method} layer")
        self._loaded.add((param_name, shard))

    def _gemv_group_words(self) -> int:
        """AWQ GEMV's words of zero points per output row: ceil(G / 8), padded to a
        multiple of 1 (group size >= 128), 2 (64) or 4 (32)."""
        words = -(-self.num_groups // 8)
        align = 1 if self.quant.group_size >= 128 or self.quant.group_size == -1 else 128 // self.quant.group_size
        return -(-words // align) * align

    def _all_float(self, layer: LinearBase) -> bool:
        return bool(self._float_rows) and all(s in self._float_rows for s in layer.layout.shards)

    def missing(self, layer: LinearBase) -> list[str]:
        """Packed tensors not loaded yet; none when every shard came in float. Float rows
        next to packed ones cannot make one layer: they are reported as what is missing
        for the packed version."""
        if self._all_float(layer):
            return []
        shards = layer.layout.shards
        missing = [piece(name, s) for s in shards for name in PACKED_TENSORS if (name, s) not in self._loaded]
        if self.row_groups:  # the group of every row can only come from g_idx
            missing += [piece("g_idx", s) for s in shards if s not in self._g_idx]
        missing += [f"{piece(name, s)} (the shard came as a float weight)"
                    for s in self._float_rows for name in PACKED_TENSORS if (name, s) not in self._loaded]
        return missing

    @torch.no_grad()
    def finish(self, layer: LinearBase) -> None:
        """Sort act-order rows and prepare the device's forward (or become dense)."""
        if self._all_float(layer):
            self._become_dense(layer)
            return
        if self.row_groups:
            self._apply_row_groups(layer)
        else:
            self._apply_g_idx(layer)
        self._g_idx.clear()
        self._dequantized = None
        if layer.qweight.device.type == "cpu":
            self._weight(layer)  # build the CPU cache now, not during the first request
        elif layer.qweight.is_cuda and layer.groups is None and _triton_available():
            self._tile_for_kernel(layer)

    def _become_dense(self, layer: LinearBase) -> None:
        """Every shard came as a float `.weight`: this layer was left unquantized, and from
        now on the dense method computes it."""
        device = layer.qweight.device
        weight = torch.empty(layer.out_features, layer.in_features, dtype=self.dtype, device=device)
        for shard, (start, size) in layer.layout.shards.items():
            copy_block("weight", weight[start:start + size], self._float_rows[shard])
        layer.qweight = layer.qzeros = layer.scales = None
        self._float_rows.clear()
        dense = DenseMethod()
        dense.adopt(layer, weight)
        layer.method = dense

    def _one_g_idx(self, layer: LinearBase) -> torch.Tensor:
        """The g_idx of this layer's rows, the same for every shard of a fused layer."""
        if set(self._g_idx) != set(layer.layout.shards):
            raise ValueError("g_idx is present for some shards of a fused layer but not others")
        g_idx = next(iter(self._g_idx.values()))
        if any(not torch.equal(g, g_idx) for g in self._g_idx.values()):
            raise ValueError("the shards of a fused layer have different g_idx (act-order); "
                             "a fused GEMM needs one input order")
        return g_idx

    def _apply_g_idx(self, layer: LinearBase) -> None:
        """Act-order checkpoints scatter groups over the input features (g_idx). Sorting
        the rows by group makes each group contiguous again, so the kernels index groups by
        row // group_size; the activations are gathered through `perm` to match."""
        if not self._g_idx:
            return
        g_idx = self._one_g_idx(layer) - self.group_rows[0]  # this rank's first group is its row 0
        k = layer.in_features
        contiguous = torch.arange(k) // self.group_size
        if torch.equal(g_idx, contiguous):
            return  # desc_act=False, or static groups: nothing to reorder
        if layer.layout.reduce:
            raise ValueError("g_idx is in act-order, but the checkpoint's quantization config does not "
                             "say desc_act=true: a row-parallel rank cannot keep only its own groups")
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError("g_idx does not assign group_size features to each group; "
                             "this act-order layout is not supported")
        device = layer.qweight.device
        bits = self.quant.bits
        q = unpack_rows(layer.qweight.data, bits)[perm.to(device)]
        layer.qweight.data.copy_(pack_rows(q, bits))
        layer.perm = frozen_param(perm.to(torch.int32).to(device))

    def _apply_row_groups(self, layer: LinearBase) -> None:
        """Act-order, row-parallel: this rank's input rows belong to groups scattered over
        the whole table, so each row keeps its group index into the full scales and zeros
        (no kernel reads that layout: CUDA dequantizes per call). Rows that turn out to be
        whole groups in order (static groups) cut the table to their groups instead."""
        g_idx = self._one_g_idx(layer)
        k, gs, k0 = layer.in_features, self.group_size, layer.layout.in_start
        if k0 % gs == 0 and k % gs == 0 and torch.equal(g_idx, torch.arange(k) // gs + k0 // gs):
            rows = slice(k0 // gs, (k0 + k) // gs)
            layer.qzeros = frozen_param(layer.qzeros.data[rows].clone())
            layer.scales = frozen_param(layer.scales.data[rows].clone())
            self.group_rows = (k0 // gs, k // gs)
            return
        layer.groups = frozen_param(g_idx.to(torch.int32).to(layer.qweight.device))

    def _tile_for_kernel(self, layer: LinearBase) -> None:
        """Re-pack qweight once into the Triton kernel's tiled layout (still 4-bit)."""
        from pagedllm.model_executor.layers.quantization import triton_w4a16

        bits = self.quant.bits
        if self.tile_k is None and triton_w4a16.supports(layer.in_features, self.group_size, bits):
            tile_k = triton_w4a16.tile_k_for(bits)
            layer.qweight = frozen_param(tile_rows(layer.qweight.data, bits, tile_k))
            self.tile_k = tile_k
            triton_w4a16.scratch(layer.qweight.device, self.dtype)  # now, not inside a graph capture

    def fill_random(self, layer: LinearBase, generator: torch.Generator, std: float) -> None:
        """Random packed words, dequantizing to about N(0, std): uniform levels around the
        middle zero point, with the scale that gives them that spread."""
        bits, pack = self.quant.bits, self.quant.pack_factor
        words = torch.randint(-2**31, 2**31 - 1, tuple(layer.qweight.shape), generator=generator,
                              dtype=torch.int64, device=generator.device)
        layer.qweight.data.copy_(words.to(torch.int32))
        mid = (1 << (bits - 1)) - self.quant.zero_offset
        word = sum(mid << (bits * j) for j in range(pack))
        layer.qzeros.data.fill_(word - 2**32 if word >= 2**31 else word)
        layer.scales.data.fill_(std * math.sqrt(12) / (1 << bits))
        shards = layer.layout.shards
        self._loaded = {(n, s) for n in PACKED_TENSORS for s in shards}
        if self.row_groups:  # groups in order: finish keeps only this rank's
            rows = (layer.layout.in_start + torch.arange(layer.in_features)) // self.group_size
            self._g_idx = {s: rows for s in shards}

    # ------------------------------------------------------------------ forward
    def dequantized_weight(self, layer: LinearBase, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(layer.qweight, layer.qzeros, layer.scales, self.group_size, self.quant.bits,
                          self.quant.zero_offset, layer.perm, dtype or self.dtype, self.tile_k,
                          layer.in_features, layer.groups)

    def _weight(self, layer: LinearBase) -> torch.Tensor:
        if self._dequantized is None or self._dequantized.device != layer.qweight.device:
            self._dequantized = self.dequantized_weight(layer)
        return self._dequantized

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and self.tile_k is not None and not batch_invariant.is_enabled():
            from pagedllm.model_executor.layers.quantization import triton_w4a16

            out = triton_w4a16.wna16_matmul(x.reshape(-1, layer.in_features), layer.qweight, layer.scales,
                                            layer.qzeros, layer.perm, self.group_size, self.quant.bits,
                                            self.quant.zero_offset)
            out = out.view(*x.shape[:-1], layer.out_features)
            return out if bias is None else out + bias
        if x.is_cuda and not batch_invariant.is_enabled():
            _warn_once("no Triton kernel for this layer: dequantizing on every call (slow)")
            return batch_invariant.linear(x, self.dequantized_weight(layer, x.dtype), bias)
        return batch_invariant.linear(x, self._weight(layer).to(x.dtype), bias)


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
