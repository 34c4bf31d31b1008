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
exactly as their float counterparts (ColumnParallelLinear) do.
"""

from __future__ import annotations

import importlib.util
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_executor.layers.quantization.config import QuantConfig
from pagedllm.model_executor.layers.quantization.packing import (
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
    """`sizes` maps shard name -> output rows (one entry named None for a plain layer)."""

    def __init__(self, in_features: int, sizes: dict[str | None, int], bias: bool, quant: QuantConfig):
        super().__init__()
        self.quant = quant
        self.in_features = in_features
        self.out_features = sum(sizes.values())
        self.group_size = quant.group_size_for(in_features)
        self.dtype = torch.get_default_dtype()  # the activations' dtype (set by the loader)
        pack = quant.pack_factor
        self.shards: dict[str | None, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            if size % pack:
                raise ValueError(f"{quant.method} needs output sizes divisible by {pack}, got {size}")
            self.shards[name] = (start, size)
            start += size
        if in_features % pack:
            raise ValueError(f"{quant.method} needs in_features divisible by {pack}, got {in_features}")
        groups = math.ceil(in_features / self.group_size)
        n = self.out_features
        self.qweight = _param(torch.empty(in_features // pack, n, dtype=torch.int32))
        self.qzeros = _param(torch.empty(groups, n // pack, dtype=torch.int32))
        self.scales = _param(torch.empty(groups, n, dtype=torch.float16))
        self.register_parameter("bias", _param(torch.empty(n)) if bias else None)
        # Row i of qweight is input feature perm[i] (act-order checkpoints, sorted at load).
        self.register_parameter("perm", None)
        # Set when the checkpoint stores this layer in float (AWQ modules_to_not_convert).
        self.register_parameter("weight", None)
        self._loaded: set[tuple[str, str | None]] = set()
        self._g_idx: dict[str | None, torch.Tensor] = {}
        self._float_rows: dict[str | None, torch.Tensor] = {}
        self._dequantized: torch.Tensor | None = None  # CPU cache, deliberately not a parameter
        self.tile_k: int | None = None  # set when qweight is in the CUDA kernel's tiled layout

    def extra_repr(self) -> str:
        q = self.quant
        return (f"in={self.in_features}, out={self.out_features}, {q.method} {q.bits}-bit, "
                f"group={q.group_size}, act_order={self.perm is not None}")

    # ------------------------------------------------------------------ loading
    def load_shard(self, param_name: str, shard: str | None, tensor: torch.Tensor) -> None:
        """Take one checkpoint tensor (`<module>.qweight` etc.) for one shard."""
        if shard not in self.shards:
            raise ValueError(f"unknown shard {shard!r}")
        start, size = self.shards[shard]
        pack = self.quant.pack_factor
        what = f"{param_name}" + (f" (shard {shard})" if shard else "")
        if param_name == "g_idx":
            if tensor.shape != (self.in_features,):
                raise ValueError(f"g_idx has shape {tuple(tensor.shape)}, expected ({self.in_features},)")
            self._g_idx[shard] = tensor.to(torch.long).cpu()
        elif param_name == "bias":
            if self.bias is None:
                # Some GPTQ exports carry zero biases the float model lacks: harmless.
                if torch.count_nonzero(tensor):
                    raise ValueError("checkpoint has a non-zero bias for a layer built without one")
                return
            self._copy(what, self.bias.data[start:start + size], tensor)
        elif param_name == "weight":
            self._float_rows[shard] = tensor
        elif param_name in _TENSORS:
            if self.quant.method == "awq" and param_name != "scales":
                tensor = awq_to_internal(param_name, tensor.to(torch.int32))
            cols = slice(start // pack, (start + size) // pack) if param_name == "qzeros" else slice(start, start + size)
            self._copy(what, getattr(self, param_name).data[:, cols], tensor)
        else:
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in a {self.quant.method} layer")
        self._loaded.add((param_name, shard))

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
        if missing or self._float_rows:
            raise ValueError(f"quantized layer is incomplete or mixes float and quantized shards: missing {missing}")
        self._apply_g_idx()
        self._g_idx.clear()
        self._dequantized = None
        if self.qweight.device.type == "cpu":
            self._weight()  # build the CPU cache now, not during the first request
        elif self.qweight.is_cuda and _triton_available():
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

    def _apply_g_idx(self) -> None:
        """Act-order checkpoints scatter groups over the input features (g_idx). Sorting
        the rows by group makes each group contiguous again, so the kernels index groups by
        row // group_size; the activations are gathered through `perm` to match."""
        if not self._g_idx:
            return
        if set(self._g_idx) != set(self.shards):
            raise ValueError("g_idx is present for some shards of a fused layer but not others")
        g_idx = next(iter(self._g_idx.values()))
        if any(not torch.equal(g, g_idx) for g in self._g_idx.values()):
            raise ValueError("the shards of a fused layer have different g_idx (act-order); "
                             "a fused GEMM needs one input order")
        k = self.in_features
        contiguous = torch.arange(k) // self.group_size
        if torch.equal(g_idx, contiguous):
            return  # desc_act=False, or static groups: nothing to reorder
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError("g_idx does not assign group_size features to each group; "
                             "this act-order layout is not supported")
        device = self.qweight.device
        bits = self.quant.bits
        q = unpack_rows(self.qweight.data, bits)[perm.to(device)]
        self.qweight.data.copy_(pack_rows(q, bits))
        self.perm = _param(perm.to(torch.int32).to(device))

    def _tile_for_kernel(self) -> None:
        """Re-pack qweight once into the Triton kernel's tiled layout (still 4-bit)."""
        from pagedllm.model_executor.layers.quantization import triton_w4a16

        bits = self.quant.bits
        if self.tile_k is None and triton_w4a16.supports(self.in_features, self.group_size, bits):
            tile_k = triton_w4a16.tile_k_for(bits)
            self.qweight = _param(tile_rows(self.qweight.data, bits, tile_k))
            self.tile_k = tile_k

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

    # ------------------------------------------------------------------ forward
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out, in] this layer computes with (tests and fallbacks)."""
        if self.weight is not None:
            return self.weight
        return dequantize(self.qweight, self.qzeros, self.scales, self.group_size, self.quant.bits,
                          self.quant.zero_offset, self.perm, dtype or self.dtype, self.tile_k,
                          self.in_features)

    def _weight(self) -> torch.Tensor:
        if self._dequantized is None or self._dequantized.device != self.qweight.device:
            self._dequantized = self.dequantized_weight()
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        if x.is_cuda and self.tile_k is not None:
            from pagedllm.model_executor.layers.quantization import triton_w4a16

            out = triton_w4a16.wna16_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales,
                                            self.qzeros, self.perm, self.group_size, self.quant.bits,
                                            self.quant.zero_offset)
            out = out.view(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        if x.is_cuda:
            _warn_once("no Triton kernel for this layer: dequantizing on every call (slow)")
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        return F.linear(x, self._weight().to(x.dtype), self.bias)


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logger.warning(msg)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
