"""x @ W.T for a decode step of one row (CUDA): one pass over the weight, made for latency.

At batch 1 a dense layer's product is a matrix-vector product: its time is reading the
weight once. cuBLAS picks a tile of 64 output rows x 8 tokens for it, and on an H200 the
Qwen3-30B-A3B step's qkv (21 MB) took 7.8 us, o_proj (17 MB) 8.9 us with its split-K
reduction and the 128-expert router (0.5 MB) 5.0 us: 55% of the card's bandwidth for the
first two and latency for the router (benchmarks/results/...-profile-moe-b1-nopdl-*.json).
Those three are a quarter of that step.

This kernel gives each program a few output rows (BN) and walks K with them in tiles of
up to 1,024, multiplying element-wise into float32 and summing each tile (no tensor
cores: at one row the product is memory, not arithmetic). The next tile is loaded before
the current one is summed, and the first before the PDL wait (pagedllm.pdl): weights are
the one thing the step never writes, so their first bytes arrive while the kernel before
still runs. Measured on an H200 inside a CUDA graph
(benchmarks/results/2026-12-06-gpu-h200-skinny-gemm-*.json), one row: o_proj 6.6 us
against cuBLAS's 8.6, the router 1.6 against 5.0, qkv and Llama-2-7B's layers within a few
percent of cuBLAS either way. At four rows the element-wise products cost more than the
read (qkv 17.5 us against 7.6), except for small weights (the router, 2.3 against 4.8).

So DenseMethod takes it for CUDA bf16/fp16 inputs of one row, or of up to MAX_ROWS
(PAGEDLLM_SKINNY_MAX_ROWS; 0 turns the kernel off) for weights of at most SMALL_WEIGHT
values, outside the batch-invariant mode (whose products have fixed tiles of their own).
A row's result does not depend on the other rows.

FP8 weights (e4m3, one float32 scale per output row) go through the same kernel: each
weight is widened to float32 as it is read and the row's sum multiplied by its scale at
the end, against bf16/fp16 activations as they are (weight-only FP8: nothing to quantize
per token). At one row the product is the weight's read, and an FP8 weight is half a bf16
one; torch._scaled_mm there took as long as the bf16 product or longer (8b.down, one row,
H200: 40 us plus 9 us to quantize the row, against 32 us in bf16;
benchmarks/results/2026-12-05-gpu-h200-fp8-gemm-*.json). Fp8Method takes it for up to
FP8_MAX_ROWS rows (PAGEDLLM_SKINNY_FP8_MAX_ROWS, default 1; 0 leaves every FP8 product to
torch._scaled_mm): on an H100 one request on the Llama-3.1-8B shape (128 in, 512 out) with
FP8 weights decoded at 208 tok/s with it against 182 without
(benchmarks/results/2026-12-07-gpu-h100-b1-8b-fp8*-52d77f0.json)."""

from __future__ import annotations

import os

import torch

from pagedllm import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch it
    triton = None

DEFAULT_MAX_ROWS = 4
SMALL_WEIGHT = 1 << 20  # values (the 128-expert router's 2048 x 128 is a quarter of it)
_DTYPES = (torch.bfloat16, torch.float16)


# read once: applies() runs for every dense product of an eager step
MAX_ROWS = int(os.environ.get("PAGEDLLM_SKINNY_MAX_ROWS", DEFAULT_MAX_ROWS))
# FP8 weights: products of one row (benchmarks/gpu_run.sh fp8-b1 / fp8-fast time it)
FP8_MAX_ROWS = int(os.environ.get("PAGEDLLM_SKINNY_FP8_MAX_ROWS", 1))
FP8 = torch.float8_e4m3fn


def _rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The rows of a product the kernel can lay out (0: none): a CUDA bf16/fp16 input, a 2-D
    weight, unit stride along K on both sides, K and the weight's row stride whole 16-byte
    runs of the weight's elements."""
    if triton is None or not x.is_cuda or x.dtype not in _DTYPES or weight.dim() != 2:
        return 0
    k, align = x.shape[-1], 16 // weight.element_size()
    if not k or weight.stride(1) != 1 or x.stride(-1) != 1 or k % align or weight.stride(0) % align:
        return 0
    return x.numel() // k


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes this product: a CUDA input in the weight's 16-bit
    dtype of one row (or up to MAX_ROWS for a small weight), laid out as _rows says (K and
    the weight's row stride multiples of 8)."""
    if weight.dtype != x.dtype:
        return False
    rows = _rows(x, weight)
    return MAX_ROWS >= 1 and rows >= 1 and (rows == 1 or (rows <= MAX_ROWS and weight.numel() <= SMALL_WEIGHT))


def applies_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `skinny_linear` takes this FP8 product: a CUDA bf16/fp16 input of at most
    FP8_MAX_ROWS rows, an e4m3 weight with one scale a row (scale [N, 1]), laid out as
    _rows says (K and the weight's row stride multiples of 16)."""
    if weight.dtype != FP8 or scale.numel() != weight.shape[0]:
        return False
    return 1 <= _rows(x, weight) <= FP8_MAX_ROWS


def launch_config(m: int, n: int, k: int, fp8: bool = False) -> tuple[int, int, int, int]:
    """(MB, BN, BK, num_warps): MB rows padded to a power of two; BK up to 1,024 keys a
    tile; BN output rows a program, 4 for wide layers and 2 below 5,120 outputs at one row,
    fewer at more rows (the fastest settings of the H200 sweep); 4 warps. FP8 weights: twice
    the output rows a program, the same bytes a tile as bf16's (not yet swept on a card:
    benchmarks/skinny_gemm_bench.py --fp8)."""
    mb = 1 << max(0, (m - 1).bit_length())
    bk = min(1024, 1 << max(6, (k - 1).bit_length()))
    bn = max(1, (4 if n >= 5120 else 2) * (2 if fp8 else 1) // mb)
    return mb, bn, bk, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for x [..., K] of few rows, weight [N, K]; `config` overrides
    launch_config (benchmarks). `scale` [N] or [N, 1] float32: an e4m3 weight's per-row
    scale, x @ (weight * scale).T; the result in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mb, bn, bk, warps = config or launch_config(m, n, k, fp8=scale is not None)
    _skinny_kernel[(triton.cdiv(n, bn),)](
        x2, weight, weight if bias is None else bias, weight if scale is None else scale, y, m, n, k,
        x2.stride(0), weight.stride(0), y.stride(0),
        MB=mb, BN=bn, BK=bk, BIAS=bias is not None, SCALED=scale is not None, num_warps=warps,
        **pdl.kernel_options(x))
    return y.view(*lead, n)


if triton is not None:
    from pagedllm.pdl import launch_dependents, wait

    @triton.jit
    def _skinny_kernel(X, W, B, S, Y, M, N, K, sxm, swn, sym, MB: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, BIAS: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        rm = tl.arange(0, MB)
        nin = rn < N
        w_ptr = W + rn[:, None].to(tl.int64) * swn + rk[None, :]
        w = tl.load(w_ptr, mask=nin[:, None] & (rk < K)[None, :], other=0.0)  # before the wait
        if PDL:  # placed early (pagedllm.pdl): wait for the kernel before, let the next be placed
            tok = wait()
            X += tok
            Y += tok
            launch_dependents()
        x_ptr = X + rm[:, None] * sxm + rk[None, :]
        acc = tl.zeros((MB, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kin = rk + k0 < K
            a = tl.load(x_ptr + k0, mask=(rm < M)[:, None] & kin[None, :], other=0.0)
            w_next = tl.load(w_ptr + (k0 + BK), mask=nin[:, None] & (rk + (k0 + BK) < K)[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            w = w_next
        if SCALED:  # an FP8 weight's row scales (read after the loop: the weight's bytes first)
            acc *= tl.load(S + rn, mask=nin, other=0.0)[None, :]
        if BIAS:
            acc += tl.load(B + rn, mask=nin, other=0.0).to(tl.float32)[None, :]
        y_ptr = Y + rm[:, None] * sym + rn[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(rm < M)[:, None] & nin[None, :])
