"""QuantizedLinear: a GPTQ/AWQ linear layer whose packed integer tensors are the weights.

The packed tensors are parameters (int32 `qweight`/`qzeros`, fp16 `scales`), so the
engine's weight memory counts what really sits in memory. How they turn into a product
depends on the device:

- CUDA: a Triton kernel reads the packed words and dequantizes inside the GEMM, so the
  weights stay 4-bit in GPU memory (triton_w4a16.py). At load, qweight is re-packed once
  into the kernel's tiled row order (packing.tile_rows), still 4 bits a value.
- CPU: one dequantized float copy per layer, built once after loading and kept outside
  the parameters. CPU serving is the correctness path; a dequantize-per-call would be
  many times slower for no memory benefit that matters there.

Fused layers (qkv, gate_up) hold their shards side by side along the output dimension,
exactly as their float counterparts (ColumnParallelLinear) do, and split over tensor-parallel
ranks the same way, along the packed layout (see QuantizedLinear).
"""

from __future__ import annotations

import importlib.util
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import all_reduce, divide, get_tp_rank, get_tp_world_size
from pagedllm.model_executor.layers.parallel import head_partition, read_block, shape_of
from pagedllm.model_executor.layers.quantization.config import QuantConfig
from pagedllm.model_executor.layers.quantization.packing import (
    awq_gemv_to_internal,
    awq_to_internal,
    dequantize,
    pack_rows,
    tile_rows,
    unpack_rows,
)

logger = logging.getLogger(__name__)

_TENSORS = ("qweight", "qzeros", "scales")


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantizedLinear(nn.Module):
    """`sizes` maps shard name -> output rows in the checkpoint (one entry named None for a
    plain layer).

    Under tensor parallelism the layer is column-parallel by default: each rank keeps an
    even slice of every shard's output features (`parts`, shard -> (first row, rows),
    chooses another split, e.g. by heads). Output features are whole columns of qweight
    and scales and whole packed words of qzeros, so the slices must start and end on a
    word. With `row_parallel` a rank keeps a slice of the input features instead: whole
    packed rows of qweight and whole groups of scales/zeros, and the partial products are
    all-reduced. Act-order checkpoints scatter the groups over the input, so there a rank
    keeps the whole (small) group table and a group index per row (`groups`).
    """

    def __init__(self, in_features: int, sizes: dict[str | None, int], bias: bool, quant: QuantConfig,
                 row_parallel: bool = False, parts: dict[str | None, tuple[int, int]] | None = None):
        super().__init__()
        rank, world = get_tp_rank(), get_tp_world_size()
        self.quant = quant
        self.dtype = torch.get_default_dtype()  # the activations' dtype (set by the loader)
        pack = quant.pack_factor
        # shard -> (rows in the checkpoint, first row this rank keeps, rows it keeps)
        self.parts: dict[str | None, tuple[int, int, int]] = {}
        self.shards: dict[str | None, tuple[int, int]] = {}  # shard -> (local start, rows)
        start = 0
        for name, size in sizes.items():
            if parts is not None:
                src, n = parts[name]
            elif row_parallel:
                src, n = 0, size
            else:
                n = divide(size, world, f"output size of {name or 'the layer'}")
                src = rank * n
            if size % pack or n % pack or src % pack:
                raise ValueError(f"{quant.method} needs output sizes divisible by {pack}"
                                 + (f" on each of {world} ranks" if world > 1 else "") + f", got {size}"
                                 + (f" split into {n}" if n != size else ""))
            self.parts[name] = (size, src, n)
            self.shards[name] = (start, n)
            start += n
        self.out_features = start
        if in_features % pack:
            raise ValueError(f"{quant.method} needs in_features divisible by {pack}, got {in_features}")
        self.full_in = in_features
        self.reduce = row_parallel and world > 1  # partial products are summed over ranks
        k = divide(in_features, world, "input size of a row-parallel layer") if self.reduce else in_features
        if k % pack:
            raise ValueError(f"{quant.method} packs {pack} input features a word: each rank's input "
                             f"slice ({k} of {in_features}) must be a multiple of {pack}")
        self.in_features, self.in_start = k, (rank * k if self.reduce else 0)
        full_group = quant.group_size_for(in_features)
        self.num_groups = math.ceil(in_features / full_group)  # rows of scales in the checkpoint
        # Act-order, row-parallel: groups are scattered over the inputs, every rank keeps them all.
        self.row_groups = self.reduce and quant.desc_act and quant.group_size != -1
        if not self.reduce or self.row_groups:
            self.group_size, self.group_rows = full_group, (0, self.num_groups)
        elif quant.group_size == -1:  # one group over all inputs: each rank has some of its rows
            self.group_size, self.group_rows = k, (0, 1)
        else:
            if k % full_group:
                raise ValueError(f"a row-parallel {quant.method} layer splits its input by whole groups: "
                                 f"{in_features} inputs in groups of {full_group} cannot be split over "
                                 f"{world} ranks")
            self.group_size, self.group_rows = full_group, (self.in_start // full_group, k // full_group)
        groups, n = self.group_rows[1], self.out_features
        self.qweight = _param(torch.empty(k // pack, n, dtype=torch.int32))
        self.qzeros = _param(torch.empty(groups, n // pack, dtype=torch.int32))
        self.scales = _param(torch.empty(groups, n, dtype=torch.float16))
        self.register_parameter("bias", _param(torch.empty(n)) if bias else None)
        # Row i of qweight is input feature perm[i] (act-order checkpoints, sorted at load).
        self.register_parameter("perm", None)
        # Group of each row, when a rank's rows are not whole groups in order (row_groups).
        self.register_parameter("groups", None)
        # Set when the checkpoint stores this layer in float (AWQ modules_to_not_convert).
        self.register_parameter("weight", None)
        self._loaded: set[tuple[str, str | None]] = set()
        self._g_idx: dict[str | None, torch.Tensor] = {}
        self._float_rows: dict[str | None, torch.Tensor] = {}
        self._dequantized: torch.Tensor | None = None  # CPU cache, deliberately not a parameter
        self.tile_k: int | None = None  # set when qweight is in the CUDA kernel's tiled layout

    @classmethod
    def qkv(cls, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
            quant: QuantConfig) -> QuantizedLinear:
        """Fused q/k/v split by heads, like ColumnParallelLinear.qkv (KV heads replicated
        when there are fewer than ranks)."""
        rank, world = get_tp_rank(), get_tp_world_size()
        q0, nq = head_partition(num_heads, rank, world, "num_attention_heads")
        k0, nk = head_partition(num_kv_heads, rank, world, "num_key_value_heads", replicate=True)
        kv = (k0 * head_dim, nk * head_dim)
        return cls(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
                   bias, quant, parts={"q": (q0 * head_dim, nq * head_dim), "k": kv, "v": kv})

    def extra_repr(self) -> str:
        q = self.quant
        split = f", rows {self.in_start}+{self.in_features} of {self.full_in}" if self.reduce else ""
        return (f"in={self.in_features}, out={self.out_features}, {q.method} {q.bits}-bit, "
                f"group={q.group_size}, act_order={self.perm is not None or self.groups is not None}{split}")

    # ------------------------------------------------------------------ loading
    def load_shard(self, param_name: str, shard: str | None, tensor) -> None:
        """Take one checkpoint tensor (`<module>.qweight` etc.) for one shard: a torch
        tensor or a lazy safetensors slice, of which only this rank's block is read."""
        if shard not in self.parts:
            raise ValueError(f"unknown shard {shard!r}")
        full, src, n = self.parts[shard]
        start = self.shards[shard][0]
        pack = self.quant.pack_factor
        awq = self.quant.method == "awq"
        gemv = self.quant.checkpoint_format == "awq_gemv"
        k0, k = self.in_start, self.in_features
        g0, ng = self.group_rows
        out_cols, word_cols = slice(src, src + n), slice(src // pack, (src + n) // pack)
        what = f"{param_name}" + (f" (shard {shard})" if shard else "")
        if param_name == "g_idx":
            self._check(what, tensor, (self.full_in,))
            self._g_idx[shard] = read_block(tensor, slice(k0, k0 + k)).to(torch.long).cpu()
        elif param_name == "bias":
            if self.bias is None:
                # Some GPTQ exports carry zero biases the float model lacks: harmless.
                if torch.count_nonzero(read_block(tensor)):
                    raise ValueError("checkpoint has a non-zero bias for a layer built without one")
                return
            self._check(what, tensor, (full,))
            self._copy(what, self.bias.data[start:start + n], read_block(tensor, out_cols))
        elif param_name == "weight":
            self._check(what, tensor, (full, self.full_in))
            self._float_rows[shard] = read_block(tensor, out_cols, slice(k0, k0 + k))
        elif gemv and param_name in _TENSORS:  # AWQ GEMV: transposed, [N, ...]
            groups = slice(g0, g0 + ng)
            if param_name == "qweight":
                self._check(what, tensor, (full, self.full_in // pack))
                block = read_block(tensor, out_cols, slice(k0 // pack, (k0 + k) // pack))
                target = self.qweight.data[:, start:start + n]
            else:
                padded = self._gemv_group_words()
                shape = (full, padded) if param_name == "qzeros" else (full, padded * pack)
                self._check(what, tensor, shape)
                block = read_block(tensor, out_cols)
                target = (self.qzeros.data[:, start // pack:(start + n) // pack] if param_name == "qzeros"
                          else self.scales.data[:, start:start + n])
            self._copy(what, target, awq_gemv_to_internal(param_name, block, groups))
        elif param_name == "qweight":
            if awq:  # [K, N / 8], packed (interleaved) along the output
                self._check(what, tensor, (self.full_in, full // pack))
                block = awq_to_internal("qweight", read_block(tensor, slice(k0, k0 + k), word_cols).to(torch.int32))
            else:  # [K / pack, N], packed along the input
                self._check(what, tensor, (self.full_in // pack, full))
                block = read_block(tensor, slice(k0 // pack, (k0 + k) // pack), out_cols)
            self._copy(what, self.qweight.data[:, start:start + n], block)
        elif param_name == "qzeros":
            self._check(what, tensor, (self.num_groups, full // pack))
            block = read_block(tensor, slice(g0, g0 + ng), word_cols)
            if awq:
                block = awq_to_internal("qzeros", block.to(torch.int32))
            self._copy(what, self.qzeros.data[:, start // pack:(start + n) // pack], block)
        elif param_name == "scales":
            self._check(what, tensor, (self.num_groups, full))
            self._copy(what, self.scales.data[:, start:start + n], read_block(tensor, slice(g0, g0 + ng), out_cols))
        else:
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in a {self.quant.method} layer")
        self._loaded.add((param_name, shard))

    def _gemv_group_words(self) -> int:
        """AWQ GEMV's words of zero points per output row: ceil(G / 8), padded to a
        multiple of 1 (group size >= 128), 2 (64) or 4 (32)."""
        words = -(-self.num_groups // 8)
        align = 1 if self.quant.group_size >= 128 or self.quant.group_size == -1 else 128 // self.quant.group_size
        return -(-words // align) * align

    @staticmethod
    def _check(what: str, tensor, expected: tuple[int, ...]) -> None:
        """The checkpoint tensor's full shape, checked before a slice of it is read (a
        slice of a wrong-sized tensor would otherwise load without error)."""
        if shape_of(tensor) != expected:
            raise ValueError(f"{what}: checkpoint shape {shape_of(tensor)} != expected {expected}")

    @staticmethod
    def _copy(what: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Check completeness, sort act-order rows, and prepare the device's forward."""
        if self._float_rows and all(k in self.shards for k in self._float_rows):
            self._become_float()
            return
        missing = [f"{name}" + (f" (shard {s})" if s else "") for s in self.shards
                   for name in _TENSORS + (("bias",) if self.bias is not None else ())
                   if (name, s) not in self._loaded]
        if self.row_groups:  # the group of every row can only come from g_idx
            missing += ["g_idx" + (f" (shard {s})" if s else "") for s in self.shards if s not in self._g_idx]
        if missing or self._float_rows:
            raise ValueError(f"quantized layer is incomplete or mixes float and quantized shards: missing {missing}")
        if self.row_groups:
            self._apply_row_groups()
        else:
            self._apply_g_idx()
        self._g_idx.clear()
        self._dequantized = None
        if self.qweight.device.type == "cpu":
            self._weight()  # build the CPU cache now, not during the first request
        elif self.qweight.is_cuda and self.groups is None and _triton_available():
            self._tile_for_kernel()

    def _become_float(self) -> None:
        """Every shard came as a float `.weight`: this layer was left unquantized."""
        device = self.qweight.device
        weight = torch.empty(self.out_features, self.in_features, dtype=self.dtype, device=device)
        for shard, (start, size) in self.shards.items():
            self._copy("weight", weight[start:start + size], self._float_rows[shard])
        self.weight = _param(weight)
        self.qweight = self.qzeros = self.scales = None
        self._float_rows.clear()

    def _one_g_idx(self) -> torch.Tensor:
        """The g_idx of this layer's rows, the same for every shard of a fused layer."""
        if set(self._g_idx) != set(self.shards):
            raise ValueError("g_idx is present for some shards of a fused layer but not others")
        g_idx = next(iter(self._g_idx.values()))
        if any(not torch.equal(g, g_idx) for g in self._g_idx.values()):
            raise ValueError("the shards of a fused layer have different g_idx (act-order); "
                             "a fused GEMM needs one input order")
        return g_idx

    def _apply_g_idx(self) -> None:
        """Act-order checkpoints scatter groups over the input features (g_idx). Sorting
        the rows by group makes each group contiguous again, so the kernels index groups by
        row // group_size; the activations are gathered through `perm` to match."""
        if not self._g_idx:
            return
        g_idx = self._one_g_idx() - self.group_rows[0]  # this rank's first group is its row 0
        k = self.in_features
        contiguous = torch.arange(k) // self.group_size
        if torch.equal(g_idx, contiguous):
            return  # desc_act=False, or static groups: nothing to reorder
        if self.reduce:
            raise ValueError("g_idx is in act-order, but the checkpoint's quantization config does not "
                             "say desc_act=true: a row-parallel rank cannot keep only its own groups")
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError("g_idx does not assign group_size features to each group; "
                             "this act-order layout is not supported")
        device = self.qweight.device
        bits = self.quant.bits
        q = unpack_rows(self.qweight.data, bits)[perm.to(device)]
        self.qweight.data.copy_(pack_rows(q, bits))
        self.perm = _param(perm.to(torch.int32).to(device))

    def _apply_row_groups(self) -> None:
        """Act-order, row-parallel: this rank's input rows belong to groups scattered over
        the whole table, so each row keeps its group index into the full scales and zeros
        (no kernel reads that layout: CUDA dequantizes per call). Rows that turn out to be
        whole groups in order (static groups) cut the table to their groups instead."""
        g_idx = self._one_g_idx()
        k, gs, k0 = self.in_features, self.group_size, self.in_start
        if k0 % gs == 0 and k % gs == 0 and torch.equal(g_idx, torch.arange(k) // gs + k0 // gs):
            rows = slice(k0 // gs, (k0 + k) // gs)
            self.qzeros = _param(self.qzeros.data[rows].clone())
            self.scales = _param(self.scales.data[rows].clone())
            self.group_rows = (k0 // gs, k // gs)
            return
        self.groups = _param(g_idx.to(torch.int32).to(self.qweight.device))

    def _tile_for_kernel(self) -> None:
        """Re-pack qweight once into the Triton kernel's tiled layout (still 4-bit)."""
        from pagedllm.model_executor.layers.quantization import triton_w4a16

        bits = self.quant.bits
        if self.tile_k is None and triton_w4a16.supports(self.in_features, self.group_size, bits):
            tile_k = triton_w4a16.tile_k_for(bits)
            self.qweight = _param(tile_rows(self.qweight.data, bits, tile_k))
            self.tile_k = tile_k
            triton_w4a16.scratch(self.qweight.device, self.dtype)  # now, not inside a graph capture

    def fill_random(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Random packed weights (load_format='dummy'), dequantizing to about N(0, std)."""
        bits, pack = self.quant.bits, self.quant.pack_factor
        words = torch.randint(-2**31, 2**31 - 1, tuple(self.qweight.shape), generator=generator,
                              dtype=torch.int64)
        self.qweight.data.copy_(words.to(torch.int32))
        mid = (1 << (bits - 1)) - self.quant.zero_offset
        word = sum(mid << (bits * j) for j in range(pack))
        self.qzeros.data.fill_(word - 2**32 if word >= 2**31 else word)
        self.scales.data.fill_(std * math.sqrt(12) / (1 << bits))
        if self.bias is not None:
            self.bias.data.zero_()
        self._loaded = {(n, s) for n in _TENSORS + ("bias",) for s in self.shards}
        if self.row_groups:  # groups in order: finish_loading keeps only this rank's
            rows = (self.in_start + torch.arange(self.in_features)) // self.group_size
            self._g_idx = {s: rows for s in self.shards}

    # ------------------------------------------------------------------ forward
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out, in] this layer computes with (tests and fallbacks)."""
        if self.weight is not None:
            return self.weight
        return dequantize(self.qweight, self.qzeros, self.scales, self.group_size, self.quant.bits,
                          self.quant.zero_offset, self.perm, dtype or self.dtype, self.tile_k,
                          self.in_features, self.groups)

    def _weight(self) -> torch.Tensor:
        if self._dequantized is None or self._dequantized.device != self.qweight.device:
            self._dequantized = self.dequantized_weight()
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce:  # row-parallel: sum the ranks' partial products, add the bias once
            y = all_reduce(self._product(x, None))
            return y if self.bias is None else y + self.bias
        return self._product(x, self.bias)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, bias)
        if x.is_cuda and self.tile_k is not None:
            from pagedllm.model_executor.layers.quantization import triton_w4a16

            out = triton_w4a16.wna16_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales,
                                            self.qzeros, self.perm, self.group_size, self.quant.bits,
                                            self.quant.zero_offset)
            out = out.view(*x.shape[:-1], self.out_features)
            return out if bias is None else out + bias
        if x.is_cuda:
            _warn_once("no Triton kernel for this layer: dequantizing on every call (slow)")
            return F.linear(x, self.dequantized_weight(x.dtype), bias)
        return F.linear(x, self._weight().to(x.dtype), bias)


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
