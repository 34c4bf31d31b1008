"""Fused small ops for CUDA (Triton): residual-add + RMSNorm, rotary, SiLU-and-mul.

RMSNorm and SiLU-and-mul can also hand their output to an FP8 layer already quantized per
token (`quant=True` / `silu_and_mul_quant`: an `Fp8Rows` of e4m3 values and float32
scales), with the arithmetic of fp8_quant_kernel applied to the values they would have
stored: the bf16 activations are never written and read back. On an H100 at 512 rows the
separate quantization took 5-15 us a layer (benchmarks/results/2026-12-07-gpu-h100-fp8-
gemm-trt-7037f9f.json).

In a decode step these ops move few bytes but, written as PyTorch expressions, each costs
several kernel launches per layer (RMSNorm alone is six); at small batch the launches, not
the bytes, set the step time. One kernel each brings a 28-layer model from ~1,100 launches
per step to ~350. The PyTorch expressions in norm.py / rotary.py / llama.py stay the
reference (and the CPU path); tests compare the two.
"""

from __future__ import annotations

import torch

from pagedllm import pdl
from pagedllm.model_executor.layers.quantization.fp8_rows import Fp8Rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers check `available()`
    triton = None


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:
    from pagedllm.model_executor.layers.quantization.fp8_quant_kernel import (
        WHOLE_ROW,
        row_scale,
        to_e4m3,
        whole_row_warps,
    )
    from pagedllm.pdl import launch_dependents, wait

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, S, rows, H, stride_xt, stride_xh, stride_rt, stride_rh, stride_y, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                         HAS_RES: tl.constexpr, GEMMA: tl.constexpr, PDL: tl.constexpr,
                         QUANT: tl.constexpr = False):
        """ROWS rows a program; row r is x[r // H, r % H] of an [T, H, N] view with any
        strides (a head's q / k inside the fused qkv output needs no copy). QUANT: Y is
        e4m3 and S gets each row's scale, from the values a plain call would store."""
        if PDL:  # placed early (pagedllm.pdl): wait for the kernel before, let the next be placed
            tok = wait()
            X += tok
            R += tok
            launch_dependents()
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        t = r // H
        h = r % H
        offs = tl.arange(0, BLOCK)
        mask = (r < rows)[:, None] & (offs < N)[None, :]
        x = tl.load(X + (t * stride_xt + h * stride_xh)[:, None] + offs[None, :], mask=mask, other=0.0)
        if HAS_RES:
            rp = R + (t * stride_rt + h * stride_rh)[:, None] + offs[None, :]
            x = x + tl.load(rp, mask=mask, other=0.0)
            tl.store(rp, x, mask=mask)  # the new residual, in place
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)[:, None]
        w = tl.load(W + offs, mask=offs < N, other=0.0)[None, :]
        if GEMMA:  # (1 + w) in float32, one rounding at the end (norm.py)
            y = xf * inv * (1.0 + w.to(tl.float32))
        else:
            y = w * (xf * inv).to(x.dtype)
        if QUANT:
            v = y.to(x.dtype).to(tl.float32)  # what the plain call stores, then quantized
            scale = row_scale(tl.max(tl.abs(v), axis=1))
            tl.store(S + r, scale, mask=r < rows)
            y = to_e4m3(v, scale[:, None])
        tl.store(Y + r[:, None] * stride_y + offs[None, :], y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_heads(X, t, stride_t, stride_h, cos, sin, d, dm, H: tl.constexpr,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        h = tl.arange(0, BLOCK_H)[:, None]
        m = (h < H) & dm[None, :]
        base = X + t * stride_t + h * stride_h + d[None, :]
        x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
        tl.store(base, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=m)
        tl.store(base + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rotate_heads(X, W, t, stride_t, stride_h, cos, sin, d, dm, eps, H: tl.constexpr,
                           HALF: tl.constexpr, BLOCK_H: tl.constexpr, GEMMA: tl.constexpr):
        """RMSNorm of each whole head (both halves) as the RMSNorm kernel computes it, then
        the rotation of the normed values; one read and one write of the heads."""
        h = tl.arange(0, BLOCK_H)[:, None]
        m = (h < H) & dm[None, :]
        base = X + t * stride_t + h * stride_h + d[None, :]
        x1 = tl.load(base, mask=m, other=0.0)
        x2 = tl.load(base + HALF, mask=m, other=0.0)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + d, mask=dm, other=0.0)[None, :]
        w2 = tl.load(W + HALF + d, mask=dm, other=0.0)[None, :]
        if GEMMA:
            n1 = (f1 * inv * (1.0 + w1.to(tl.float32))).to(x1.dtype).to(tl.float32)
            n2 = (f2 * inv * (1.0 + w2.to(tl.float32))).to(x1.dtype).to(tl.float32)
        else:
            n1 = (w1 * (f1 * inv).to(x1.dtype)).to(x1.dtype).to(tl.float32)
            n2 = (w2 * (f2 * inv).to(x1.dtype)).to(x1.dtype).to(tl.float32)
        tl.store(base, (n1 * cos - n2 * sin).to(X.dtype.element_ty), mask=m)
        tl.store(base + HALF, (n2 * cos + n1 * sin).to(X.dtype.element_ty), mask=m)

    @triton.jit
    def _rotary_kernel(Q, K, positions, COS, SIN, WQ, WK, eps, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_c, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
                       NORM: tl.constexpr = False, GEMMA: tl.constexpr = False):
        if PDL:
            tok = wait()
            Q += tok
            K += tok
            positions += tok
            launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(positions + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < HALF
        cos = tl.load(COS + pos * stride_c + d, mask=dm, other=0.0)[None, :]
        sin = tl.load(SIN + pos * stride_c + d, mask=dm, other=0.0)[None, :]
        if NORM:
            _norm_rotate_heads(Q, WQ, t, stride_qt, stride_qh, cos, sin, d, dm, eps, HQ, HALF, BLOCK_HQ, GEMMA)
            _norm_rotate_heads(K, WK, t, stride_kt, stride_kh, cos, sin, d, dm, eps, HKV, HALF, BLOCK_HKV, GEMMA)
        else:
            _rotate_heads(Q, t, stride_qt, stride_qh, cos, sin, d, dm, HQ, HALF, BLOCK_HQ)
            _rotate_heads(K, t, stride_kt, stride_kh, cos, sin, d, dm, HKV, HALF, BLOCK_HKV)

    @triton.jit
    def _silu_mul_kernel(X, Y, stride_x, stride_y, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            X += wait()
            launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < N
        gate = tl.load(X + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + N + col, mask=mask, other=0.0)
        out = (gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up
        tl.store(Y + row * stride_y + col, out, mask=mask)

    @triton.jit
    def _silu_mul_quant_kernel(X, Y, S, stride_x, stride_y, N: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        """One row a program, whole in registers: silu(gate) * up as _silu_mul_kernel
        computes it, then its per-token e4m3 values and scale."""
        if PDL:
            X += wait()
            launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BLOCK)
        mask = col < N
        gate = tl.load(X + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + N + col, mask=mask, other=0.0)
        v = ((gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(v), axis=0))
        tl.store(S + row, scale)
        tl.store(Y + row * stride_y + col, to_e4m3(v, scale).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, gemma: bool = False, quant: bool = False):
    """RMSNorm of the last dim; with `residual` (x's shape), x + residual is normed and
    written back into `residual`. `gemma`: scaled by (1 + weight) in float32 (norm.py).
    `quant`: the output as an Fp8Rows (per-token e4m3, for an FP8 layer) of [rows, N].

    A [T, H, N] input is read through its strides (Qwen3's per-head q / k norms take
    their heads out of the fused qkv output without a copy), and a program takes several
    short rows: one 128-value row a program left most of a 16k-token prefill's norm time
    to launching programs. The rows a program takes depend on N alone, so a row's result
    does not depend on the batch (the batch-invariant mode)."""
    shape, n = x.shape, x.shape[-1]
    if x.dim() == 3 and x.stride(2) == 1:
        t, heads = x.shape[0], x.shape[1]
        xs = (x.stride(0), x.stride(1))
    else:
        x = x.reshape(-1, n)  # a view where the strides allow
        if x.stride(1) != 1:  # the kernel walks a row's values with unit stride
            x = x.contiguous()
        t, heads = x.shape[0], 1
        xs = (x.stride(0), 0)
    rs = xs
    if residual is not None:
        residual = residual.view(x.shape)
        rs = (residual.stride(0), residual.stride(1) if heads > 1 else 0)
    rows = t * heads
    y = torch.empty((rows, n), dtype=Fp8Rows.FP8 if quant else x.dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if quant else y
    block = _pow2(n)
    per = max(1, min(32, 2048 // block))
    _rms_norm_kernel[(triton.cdiv(rows, per),)](
        x, x if residual is None else residual, weight, y, scale, rows, heads, *xs, *rs, y.stride(0), eps,
        N=n, BLOCK=block, ROWS=per, HAS_RES=residual is not None, GEMMA=gemma, QUANT=quant,
        **pdl.kernel_options(x), num_warps=4 if n <= 4096 else 8)
    if quant:
        return Fp8Rows(y, scale, x.dtype)
    return y.view(shape)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None) -> None:
    """Neox-style rotation of the first 2*cos.shape[1] dims of q [T, Hq, D] and k [T, Hkv, D],
    in place. `norm` = (q weight, k weight, eps, gemma): each head is RMS-normed first
    (Qwen3 / Gemma 3's q_norm and k_norm) in the same pass; the rotation must then cover
    the whole head (2*cos.shape[1] == D)."""
    half = cos.shape[1]
    hq, hkv = q.shape[1], k.shape[1]
    if norm is not None and 2 * half != q.shape[2]:
        raise ValueError("a fused q/k norm needs the rotation to cover the whole head")
    wq, wk, eps, gemma = norm if norm is not None else (cos, cos, 0.0, False)  # any pointer when unused
    _rotary_kernel[(q.shape[0],)](q, k, positions, cos, sin, wq, wk, eps, q.stride(0), q.stride(1), k.stride(0),
                                  k.stride(1), cos.stride(0), HQ=hq, HKV=hkv, HALF=half,
                                  BLOCK_HQ=_pow2(hq), BLOCK_HKV=_pow2(hkv), BLOCK_D=_pow2(half),
                                  NORM=norm is not None, GEMMA=gemma,
                                  num_warps=4, **pdl.kernel_options(q))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(1024, _pow2(n))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, y, x2.stride(0), y.stride(0), N=n,
                                                           BLOCK=block, num_warps=4,
                                                           **pdl.kernel_options(x))
    return y.view(*x.shape[:-1], n)


def silu_and_mul_quant(x: torch.Tensor) -> Fp8Rows:
    """silu_and_mul's result [rows, n] quantized per token for an FP8 layer, without
    writing it in x's dtype (rows of more than WHOLE_ROW values: the two kernels)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if n > WHOLE_ROW:
        from pagedllm.model_executor.layers.quantization.fp8 import quantize_tokens

        return Fp8Rows(*quantize_tokens(silu_and_mul(x2)), x.dtype)
    y = torch.empty((x2.shape[0], n), dtype=Fp8Rows.FP8, device=x.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    block = _pow2(n)
    if x2.shape[0]:
        _silu_mul_quant_kernel[(x2.shape[0],)](x2, y, scale, x2.stride(0), y.stride(0), N=n, BLOCK=block,
                                               num_warps=whole_row_warps(block), **pdl.kernel_options(x))
    return Fp8Rows(y, scale, x.dtype)
