"""The FP8 weight method: e4m3 weights with float32 scales, multiplied by torch._scaled_mm.

A layer keeps its rank's block of the checkpoint's fp8 `weight` [out, in] as it is (one
byte a weight) and one internal scale table, `weight_scale` [out, ceil(in / k_block)]
float32: every output row has its own scale for each run of `k_block` input columns. All
the published granularities are that table with some repetition:

- per tensor: one value repeated over the rows of its shard. A fused layer (q|k|v,
  gate|up) whose shards were calibrated separately keeps each shard's scale on its own
  rows instead of requantizing the shards to a common scale (as vLLM does): exact, and the
  row-wise scaled matmul costs the same as the tensor-wise one.
- per output channel: one column (k_block = in).
- per block (transformers FineGrainedFP8, compressed-tensors block/group): the block rows
  repeated per output row, so a rank may start its rows anywhere (a KV head of 64 rows
  inside a 128-row block), at 4 bytes per row and block of 128 inputs (3% of the weight).

Under tensor parallelism the scales follow the weight: column-parallel ranks keep the scale
rows of their output rows (a per-tensor scale is replicated), row-parallel ranks keep every
output row and, for block scales, the scale columns of their input slice, which must start
on a block (a clear error otherwise).

How a product is computed is decided once, at `finish`:

- CUDA with FP8 tensor cores (compute capability 8.9 or newer): the weight stays fp8 and
  `weight.t()` is already the column-major operand torch._scaled_mm wants. Activations
  are quantized per token (per token and block of 128 inputs for block scales) at run
  time; the product comes out in bf16. A probe call at load compares the FP8 product with
  the dequantized weights: if torch._scaled_mm refuses the shapes or disagrees, the layer
  is dequantized instead (the guard runs at load, not in the forward, which may be inside a
  CUDA graph capture).
- Anywhere else (CPU, older GPUs, ROCm): the weight is dequantized once into the model's
  dtype and from then on the layer is a plain float layer (batch_invariant.linear, so the
  batch-invariant mode works), with one log line saying so.

`quantization="fp8"` on a float checkpoint ("float" format) quantizes each shard as it
arrives, per output row (scale = row amax / 448) over the rank's own input columns, as
vLLM quantizes each rank's block. A layer whose every shard arrives in float in an FP8
checkpoint (compressed-tensors `ignore`, transformers `modules_to_not_convert`) becomes a
dense layer, as the packed method does for AWQ's unconverted modules.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm import batch_invariant
from pagedllm.config import env_flag
from pagedllm.model_executor.layers import skinny_gemm
from pagedllm.model_executor.layers.quantization.config import QuantConfig
from pagedllm.model_executor.layers.quantization.fp8_rows import Fp8Rows
from pagedllm.model_executor.layers.sharding import (
    check_shape,
    copy_block,
    dtype_of,
    read_block,
    shape_of,
)
from pagedllm.model_executor.layers.weight_method import (
    DenseMethod,
    WeightMethod,
    frozen_param,
    piece,
)

if TYPE_CHECKING:
    from pagedllm.model_executor.layers.linear import LinearBase

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12  # an all-zero row still gets a finite scale (its values quantize to 0)
SCALED_MM_BLOCK = 128  # the only input block torch._scaled_mm's block-scaled recipes take
# Relative (Frobenius) error of the probe's FP8 product against the dequantized weights: per
# token e4m3 activations cost ~4%; a wrong scale layout or transpose costs ~100%.
PROBE_TOLERANCE = 0.25
# Checkpoint tensors some FP8 formats carry that this method reads and drops: static
# activation scales (activations are quantized per token at run time instead) and the
# all-zero zero points of symmetric schemes.
STATIC_ACTIVATION_SCALES = ("input_scale", "activation_scale", "input_scale_ub")
ZERO_POINTS = ("weight_zero_point", "input_zero_point")
# The layer before an FP8 product (RMSNorm, SiLU-and-mul) quantizes its output for it
# (fp8_rows.py); off: each FP8 layer quantizes its own input.
FUSED_QUANT = env_flag("PAGEDLLM_FP8_FUSED_QUANT", default=True)
# The row-wise products accumulate in the tensor cores' own precision instead of being
# promoted to float32 along K (cuBLASLt's fast-accumulation mode, torch._scaled_mm's
# use_fast_accum), as the CUTLASS FP8 "FastAccum" kernels serving engines run do. On an
# H100 the Llama-3.1-8B layer's four products took 205 us against 223 at 512 rows and
# 2,681 against 2,945 at 8,192 (gate_up and down gain most), and the product's error
# against float32 on the same e4m3 operands went from 1.7e-3 to 2.0e-3 (3.1e-3 at K =
# 14,336), beside the ~2.7e-2 of e4m3 activations themselves
# (benchmarks/results/2026-12-07-gpu-h100-fp8-scaling-cb78706.json).
# PAGEDLLM_FP8_FAST_ACCUM=0 promotes again. Read at start-up; a module attribute so tests can set it.
FAST_ACCUM = env_flag("PAGEDLLM_FP8_FAST_ACCUM", default=True)


try:  # CUDA only; Triton-less installs keep the torch form
    from pagedllm.model_executor.layers.quantization.fp8_quant_kernel import (
        quantize_tokens_triton as _triton_quant,
    )
except ImportError:  # pragma: no cover
    _triton_quant = None


# ---------------------------------------------------------------------------- arithmetic
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row e4m3: (fp8 weight, float32 scale [rows, 1]), scale = row amax / 448,
    w ~ fp8 * scale. Used for quantization="fp8" and for random (dummy) weights."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, k_block: int, dtype: torch.dtype) -> torch.Tensor:
    """fp8 weight [rows, in] times its scale table [rows, ceil(in / k_block)], in float32
    (exact for bf16/fp16 scales; one float32 rounding for float32 ones), then cast to
    `dtype`."""
    k = weight.shape[1]
    s = scale if scale.shape[1] == 1 else scale.repeat_interleave(k_block, dim=1)[:, :k]
    return (weight.float() * s).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 activations: (fp8 [M, K], float32 scale [M, 1]). On CUDA one
    Triton pass (fp8_quant_kernel) does the same arithmetic."""
    if x.is_cuda and _triton_quant is not None:
        return _triton_quant(x)
    return quantize_tokens_torch(x)


def quantize_tokens_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # times the float32 reciprocal, as CUDA torch divides by a Python scalar anyway (and
    # as the Triton kernel does): the two forms agree bit for bit
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX) * (1.0 / FP8_MAX)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_token_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 activations per token and run of `block` inputs: (fp8 [M, K], float32
    scale [M, ceil(K / block)] stored outer-dim-major, strides (1, M), as torch._scaled_mm's
    1x128 recipe requires)."""
    m, k = x.shape
    nkb = math.ceil(k / block)
    xf = x.float()
    if k % block:
        xf = F.pad(xf, (0, nkb * block - k))
    xg = xf.view(m, nkb, block)
    scale = xg.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX  # [M, nkb]
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(m, nkb * block)[:, :k]
    return q.to(FP8).contiguous(), scale.t().contiguous().t()


def rowwise_mm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-token e4m3 activations xq [M, K] with float32 scales xs [M, 1] @ (fp8 weight
    [N, K] * per-row scale [N, 1]).T -> bf16 [M, N]: torch._scaled_mm's row-wise recipe
    (with FAST_ACCUM, in fast-accumulation mode)."""
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=FAST_ACCUM)


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k_block: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (fp8 weight [N, K] * scale).T -> bf16 [M, N] on FP8
    tensor cores.

    torch._scaled_mm takes a row-major A and a column-major B: `weight.t()` of the
    contiguous [N, K] weight is that B with no copy. One scale column (per tensor or per
    channel): row-wise scaling, scale_a [M, 1] and scale_b [1, N] float32, both contiguous
    (bf16 output; no padding of M). Block scales: the 1x128 x 1x128 recipe (SM90, cuBLAS
    >= 12.9), scale_a [M, K/128] and scale_b [K/128, N], the latter being `scale.t()` of
    the [N, K/128] table stored column-major at load.
    """
    if scale.shape[1] == 1:
        return rowwise_mm(*quantize_tokens(x), weight, scale)
    if x.shape[0] == 1:
        # One row's [1, K/128] scale also reads as a 128x128-block scale of A, which
        # _scaled_mm would pick first; two rows keep decode on the same 1x128 recipe.
        return scaled_mm(F.pad(x, (0, 0, 0, 1)), weight, scale, k_block)[:1]
    xq, xs = quantize_token_blocks(x, k_block)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.t(), out_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------- logging
_logged: set[str] = set()


def _log_once(level: int, msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.log(level, msg)


# ---------------------------------------------------------------------------- the method
class Fp8Method(WeightMethod):
    """FP8 (e4m3) weights with float32 scales; see the module docstring."""

    name = "fp8"
    skinny = False  # set by finish: products of a few rows go through skinny_gemm (weight-only)

    def __init__(self, quant: QuantConfig):
        self.quant = quant
        self.dtype = torch.get_default_dtype()  # the model's dtype (set by the loader)
        self._loaded: set[tuple[str, str | None]] = set()  # ("weight" | "scale", shard)
        self._float_rows: dict[str | None, torch.Tensor] = {}  # shards a checkpoint left in float
        self.k_block = 0  # input columns per scale column (set by create)
        self.fp8_matmul = False  # set by finish: the weight stays fp8 and torch._scaled_mm multiplies

    # ------------------------------------------------------------------ create
    def create(self, layer: LinearBase) -> None:
        layout, quant = layer.layout, self.quant
        n, k, k0 = layout.out_features, layout.in_features, layout.in_start
        if quant.block_size is None:
            self.k_block = k
        else:
            self.k_block = cols = quant.block_size[1]
            end = k0 + k
            if k0 % cols or (end % cols and end != layout.full_in):
                raise ValueError(f"a row-parallel FP8 layer splits its input by whole scale blocks of {cols} "
                                 f"columns: input columns {k0}..{end} of {layout.full_in} cut through a block")
        layer.weight = frozen_param(torch.empty(n, k, dtype=FP8))
        layer.weight_scale = frozen_param(torch.empty(n, math.ceil(k / self.k_block), dtype=torch.float32))

    def describe(self, layer: LinearBase) -> str:
        q = self.quant
        if layer.weight is not None and layer.weight.dtype != FP8:
            return f"fp8 ({q.checkpoint_format}) dequantized to {layer.weight.dtype}"
        block = f" {q.block_size[0]}x{q.block_size[1]}" if q.block_size else ""
        return f"fp8 e4m3 ({q.checkpoint_format}), {q.strategy}{block} scales, scaled_mm={self.fp8_matmul}"

    # ------------------------------------------------------------------ loading
    def load(self, layer: LinearBase, param_name: str, shard: str | None, tensor) -> None:
        layout = layer.layout
        full, src, rows = layout.parts[shard]
        start = layout.shards[shard][0]
        k0, k = layout.in_start, layout.in_features
        what = piece(param_name, shard)
        if param_name == "weight":
            check_shape(what, tensor, (full, layout.full_in))
            block = read_block(tensor, slice(src, src + rows), slice(k0, k0 + k))
            if block.dtype == FP8:
                if self.quant.checkpoint_format == "float":
                    raise ValueError(f"{what} is fp8, but the checkpoint has no FP8 quantization_config")
                copy_block(what, layer.weight.data[start:start + rows], block)
            elif not block.is_floating_point() or block.dtype.itemsize == 1:
                raise ValueError(f"{what} is {block.dtype}: an FP8 layer takes float8_e4m3fn weights")
            elif self.quant.checkpoint_format == "float":  # quantization="fp8": quantize on arrival
                q, scale = quantize_rows(block.to(layer.weight.device))
                copy_block(what, layer.weight.data[start:start + rows], q)
                layer.weight_scale.data[start:start + rows].copy_(scale)
                self._loaded.add(("scale", shard))
            else:  # a module the checkpoint left unquantized
                self._float_rows[shard] = block
            self._loaded.add(("weight", shard))
        elif param_name in self.quant.scale_names and self.quant.checkpoint_format != "float":
            self._load_scale(layer, shard, tensor, what)
            self._loaded.add(("scale", shard))
        elif param_name in ZERO_POINTS:
            if torch.count_nonzero(read_block(tensor).float()):
                raise ValueError(f"{what} is not zero: asymmetric FP8 is not supported")
        elif param_name in STATIC_ACTIVATION_SCALES:
            _log_once(logging.INFO, "FP8 checkpoint's static activation scales are not used: "
                                    "activations are quantized per token at run time")
        else:
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in an FP8 linear layer "
                             f"({self.quant.checkpoint_format})")

    def _load_scale(self, layer: LinearBase, shard: str | None, tensor, what: str) -> None:
        """This shard's rows of the scale table, from the checkpoint's tensor of the
        configured granularity (its full shape checked before anything is sliced)."""
        layout, quant = layer.layout, self.quant
        full, src, rows = layout.parts[shard]
        start = layout.shards[shard][0]
        target = layer.weight_scale.data[start:start + rows]
        if dtype_of(tensor) in (torch.int8, torch.uint8, torch.int32, torch.int64):
            raise ValueError(f"{what} has dtype {dtype_of(tensor)}, not a float scale")
        if quant.strategy == "tensor":
            if math.prod(shape_of(tensor)) != 1:
                raise ValueError(f"{what}: checkpoint shape {shape_of(tensor)} is not one per-tensor scale")
            block = read_block(tensor).float().reshape(1, 1).expand(rows, target.shape[1])
        elif quant.strategy == "channel":
            shape = shape_of(tensor)
            check_shape(what, tensor, (full, 1) if len(shape) == 2 else (full,))
            block = read_block(tensor, slice(src, src + rows)).float().reshape(rows, 1)
        else:
            block_rows, block_cols = quant.block_size
            shape = shape_of(tensor)
            if len(shape) == 4 and shape[1] == shape[3] == 1:  # ModelOpt's [out blocks, 1, in blocks, 1]
                tensor = read_block(tensor).reshape(shape[0], shape[2])
            check_shape(what, tensor, (math.ceil(full / block_rows), math.ceil(layout.full_in / block_cols)))
            r0 = src // block_rows
            c0 = layout.in_start // block_cols
            part = read_block(tensor, slice(r0, math.ceil((src + rows) / block_rows)),
                              slice(c0, c0 + target.shape[1])).float()
            offset = src - r0 * block_rows
            block = part.repeat_interleave(block_rows, dim=0)[offset:offset + rows]
        copy_block(what, target, block)

    def _all_float(self, layer: LinearBase) -> bool:
        return bool(self._float_rows) and all(s in self._float_rows for s in layer.layout.shards)

    def missing(self, layer: LinearBase) -> list[str]:
        """FP8 tensors not loaded yet; none when every shard came in float. A float shard
        beside fp8 ones cannot make one layer: it is reported as its missing scale."""
        if self._all_float(layer):
            return []
        names = {"weight": "weight", "scale": self.quant.scale_names[0]}
        missing = [piece(names[kind], s) for s in layer.layout.shards for kind in names
                   if (kind, s) not in self._loaded]
        missing += [f"{piece(names['scale'], s)} (the shard came as a float weight)" for s in self._float_rows
                    if ("scale", s) not in self._loaded]
        return list(dict.fromkeys(missing))

    @torch.no_grad()
    def finish(self, layer: LinearBase) -> None:
        """Decide the compute path once: FP8 tensor cores where the device has them and a
        probe call agrees, the dequantized weight everywhere else (or a dense layer)."""
        if self._all_float(layer):
            self._become_dense(layer)
            return
        self._float_rows.clear()
        reason = self._why_not_fp8(layer)
        if reason is None:
            if self.k_block != layer.in_features:  # block scales: scale_b must be column-major
                layer.weight_scale = frozen_param(layer.weight_scale.data.t().contiguous().t())
            reason = self._probe(layer)
            level = logging.WARNING
        else:
            level = logging.INFO
        if reason is None:
            self.fp8_matmul = True
            self.skinny = self._probe_skinny(layer)
            return
        _log_once(level, f"FP8 weights dequantized to {str(self.dtype).removeprefix('torch.')} at load: {reason}")
        weight = dequantize(layer.weight.data, layer.weight_scale.data, self.k_block, self.dtype)
        layer.weight = frozen_param(weight)
        layer.weight_scale = None

    def _why_not_fp8(self, layer: LinearBase) -> str | None:
        """Why this layer cannot keep its fp8 weights on this device (None: it can)."""
        device = layer.weight.device
        if device.type != "cuda" or torch.version.hip is not None:
            return "this device has no FP8 matmul"
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return "this device has no FP8 matmul"
        if layer.in_features % 16 or layer.out_features % 16:
            return (f"torch._scaled_mm needs both dimensions a multiple of 16 "
                    f"({layer.out_features} x {layer.in_features})")
        if self.k_block != layer.in_features:
            if self.k_block != SCALED_MM_BLOCK:
                return f"torch._scaled_mm takes blocks of {SCALED_MM_BLOCK} inputs, not {self.k_block}"
            if capability[0] != 9:
                return "torch._scaled_mm multiplies 128-block scaled weights only on SM90 (Hopper)"
        return None

    def _probe(self, layer: LinearBase) -> str | None:
        """One FP8 product at load for 1 and 17 rows (decode and an odd prefill), compared
        with the dequantized weight's on up to 256 output rows. None when it agrees."""
        return self._off_dequantized(layer, "torch._scaled_mm", (1, 17),
                                     lambda x: scaled_mm(x, layer.weight.data, layer.weight_scale.data, self.k_block),
                                     (RuntimeError, NotImplementedError, ValueError))

    def _off_dequantized(self, layer: LinearBase, what: str, row_counts: tuple[int, ...], product,
                         errors: tuple[type[BaseException], ...]) -> str | None:
        """Why `product` (x -> x @ W.T) is not this layer's product (None: it is): it raised
        one of `errors`, or at some row count it was PROBE_TOLERANCE or more off the
        dequantized weight's product on up to 256 output rows."""
        weight, scale = layer.weight.data, layer.weight_scale.data
        rows = min(layer.out_features, 256)
        reference = dequantize(weight[:rows], scale[:rows], self.k_block, torch.float32)
        generator = torch.Generator(device=weight.device).manual_seed(0)
        for m in row_counts:
            x = torch.randn(m, layer.in_features, generator=generator, device=weight.device).to(self.dtype)
            try:
                got = product(x)[:, :rows].float()
            except errors as e:
                return f"{what} refused the layer ({str(e).splitlines()[0]})"
            want = x.float() @ reference.T
            err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
            if not err < PROBE_TOLERANCE:
                return f"{what} was {err:.0%} off the dequantized product ({m} rows)"
        return None

    def _probe_skinny(self, layer: LinearBase) -> bool:
        """Whether the few-row kernel (skinny_gemm, weight-only FP8) takes this layer's
        products of up to FP8_MAX_ROWS rows: per-row scales, a 16-bit model and a probe row
        that compiles and agrees with the dequantized weight (else torch._scaled_mm keeps
        them, with a log line)."""
        if skinny_gemm.FP8_MAX_ROWS < 1:
            return False
        weight, scale = layer.weight.data, layer.weight_scale.data
        if not skinny_gemm.applies_fp8(torch.empty(1, layer.in_features, dtype=self.dtype, device=weight.device),
                                       weight, scale):
            return False
        # any exception: a kernel that does not build here leaves the products to _scaled_mm
        reason = self._off_dequantized(layer, "the FP8 few-row kernel", (1,),
                                       lambda x: skinny_gemm.skinny_linear(x, weight, scale=scale.reshape(-1)),
                                       (Exception,))
        if reason is not None:
            _log_once(logging.WARNING, f"{reason}: torch._scaled_mm takes every FP8 product")
        return reason is None

    def _become_dense(self, layer: LinearBase) -> None:
        """Every shard came as a float `.weight`: the checkpoint left this layer
        unquantized, and from now on the dense method computes it."""
        weight = torch.empty(layer.out_features, layer.in_features, dtype=self.dtype, device=layer.weight.device)
        for shard, (start, size) in layer.layout.shards.items():
            copy_block("weight", weight[start:start + size], self._float_rows[shard])
        self._float_rows.clear()
        layer.weight_scale = None
        dense = DenseMethod()
        dense.adopt(layer, weight)
        layer.method = dense

    def fill_random(self, layer: LinearBase, generator: torch.Generator, std: float) -> None:
        """Random fp8 weights of about N(0, std), per-row scales repeated over the table."""
        w = torch.empty(layer.out_features, layer.in_features, device=generator.device)
        q, scale = quantize_rows(w.normal_(0.0, std, generator=generator))
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale.expand_as(layer.weight_scale))
        self._loaded = {(kind, s) for kind in ("weight", "scale") for s in layer.layout.shards}

    # ------------------------------------------------------------------ forward
    def dequantized_weight(self, layer: LinearBase, dtype: torch.dtype | None = None) -> torch.Tensor:
        if layer.weight.dtype != FP8:  # dequantized at load
            return layer.weight if dtype is None else layer.weight.to(dtype)
        return dequantize(layer.weight, layer.weight_scale, self.k_block, dtype or self.dtype)

    def takes_fp8_rows(self, layer: LinearBase, rows: int | None = None) -> bool:
        """Per-token scaled activations fit the row-wise product (one scale column) on FP8
        tensor cores, outside the batch-invariant mode (which dequantizes instead), unless
        the few-row kernel takes `rows` rows (it reads the float input).
        PAGEDLLM_FP8_FUSED_QUANT=0 (read at start-up) makes every layer quantize its own
        input again: the A/B of `benchmarks/gpu_run.sh trt` (TRT_FUSED_QUANT)."""
        if self.skinny and rows is not None and rows <= skinny_gemm.FP8_MAX_ROWS:
            return False
        return (FUSED_QUANT and self.fp8_matmul and self.k_block == layer.in_features
                and not batch_invariant.is_enabled())

    def apply(self, layer: LinearBase, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Rows):  # quantized by the layer before (takes_fp8_rows said so)
            out = rowwise_mm(x.q, x.scale, layer.weight, layer.weight_scale).to(x.dtype)
            return out if bias is None else out + bias
        if not self.fp8_matmul:
            return batch_invariant.linear(x, layer.weight, bias)
        if batch_invariant.is_enabled():
            # torch._scaled_mm picks its kernel by the batch's size; the fixed-tile matmul
            # on the dequantized weight keeps a row's result independent of the batch.
            _log_once(logging.WARNING, "batch-invariant mode: FP8 layers dequantize their weights on every call")
            return batch_invariant.linear(x, self.dequantized_weight(layer, x.dtype), bias)
        if self.skinny and skinny_gemm.applies_fp8(x, layer.weight, layer.weight_scale):
            # a decode step of a few rows: one pass over the fp8 weight, activations as they are
            return skinny_gemm.skinny_linear(x, layer.weight, bias, scale=layer.weight_scale.reshape(-1))
        out = scaled_mm(x.reshape(-1, layer.in_features), layer.weight, layer.weight_scale, self.k_block)
        out = out.view(*x.shape[:-1], layer.out_features).to(x.dtype)
        return out if bias is None else out + bias
