"""Dynamic per-token e4m3 quantization of activations in one pass (CUDA, Triton).

The torch form (abs, amax, divide, clamp, cast) is five kernels and a float32 copy of the
activations per linear layer; at decode those launches and passes cost more than the
FP8 product saves. One program per token row computes the row's amax and writes the e4m3
values and the float32 scale `amax / 448`, the same arithmetic as `fp8.quantize_tokens`:
the scale times the float32 reciprocal of 448 and an IEEE-rounded division (`div_rn`;
Triton's `/` is the approximate one on CUDA) for the values, so the two agree bit for bit.

A row of up to WHOLE_ROW values (every Llama-class hidden and intermediate size) is held
in registers and read once: at 512 rows of 14,336 (Llama-3.1-8B's down projection) the
two-pass loop it replaces took 15 us of a 60 us layer on an H100
(benchmarks/results/2026-12-07-gpu-h100-fp8-gemm-trt-7037f9f.json). Longer rows loop
twice over blocks (the second read from L2).

`row_scale` and `to_e4m3` are the arithmetic itself, shared with the kernels that quantize
as they produce activations (fused_ops: RMSNorm, SiLU-and-mul), so every path rounds alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
WHOLE_ROW = 16384  # longest row held in registers (32 values a thread at 16 warps)
_BLOCK = 1024
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_INV_FP8_MAX: tl.constexpr = tl.constexpr(1.0 / FP8_MAX)
_MIN_AMAX: tl.constexpr = tl.constexpr(MIN_AMAX)


@triton.jit
def row_scale(amax):
    """The per-token scale of a row (or of each row of a [R, N] block) from its amax."""
    return tl.maximum(amax, _MIN_AMAX) * _INV_FP8_MAX


@triton.jit
def to_e4m3(v, scale):
    """float32 values over their row's scale, rounded once and saturated to e4m3's range
    (the caller casts to the fp8 pointer's type on store)."""
    return tl.clamp(tl.math.div_rn(v, scale), -_FP8_MAX, _FP8_MAX)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          WHOLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if WHOLE:  # the row in registers: one read
        mask = offs < K
        v = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(v), axis=0))
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + offs, to_e4m3(v, scale).to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            tl.store(q_ptr + row * stride_q + k0 + offs, to_e4m3(v.to(tl.float32), scale).to(q_ptr.dtype.element_ty),
                     mask=k0 + offs < K)


def whole_row_warps(block: int) -> int:
    """Warps for a program holding `block` values of a row: 32 a thread, 4 to 16 warps."""
    return min(16, max(4, block // 1024))


def quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row stride free, unit column stride) -> (e4m3 [M, K], float32 [M, 1])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        whole = k <= WHOLE_ROW
        block = triton.next_power_of_2(k) if whole else _BLOCK
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, WHOLE=whole,
                                    num_warps=whole_row_warps(block) if whole else 4)
    return q, s
