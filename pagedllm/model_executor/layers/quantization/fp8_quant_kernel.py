"""Dynamic per-token e4m3 quantization of activations in one pass (CUDA, Triton).

The torch form (abs, amax, divide, clamp, cast) is five kernels and a float32 copy of the
activations per linear layer; at decode those launches and passes cost more than the
FP8 product saves. One program per token row reads the row once for its amax and once
more (from L2) to write the e4m3 values and the float32 scale `amax / 448`, the same
arithmetic as `fp8.quantize_tokens`: the scale times the float32 reciprocal of 448 and an
IEEE-rounded division (`div_rn`; Triton's `/` is the approximate one on CUDA) for the
values, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12
_BLOCK = 1024


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q,
                          FP8_MAX: tl.constexpr, INV_FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), MIN_AMAX) * INV_FP8_MAX
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
        q = tl.clamp(tl.math.div_rn(v.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)


def quantize_tokens_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row stride free, unit column stride) -> (e4m3 [M, K], float32 [M, 1])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX, INV_FP8_MAX=1.0 / FP8_MAX,
                                    MIN_AMAX=MIN_AMAX, BLOCK=_BLOCK, num_warps=4)
    return q, s
