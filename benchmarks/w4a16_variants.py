"""Candidate W4A16 kernels for more than one row, measured against the package's kernel and
bf16 before one replaces it (issue: quantized decode at batch 16 / 256 is slower than bf16).

- `plane_dot`: each packed word is loaded once; every 16-row plane of a tile is unpacked to
  exact small integers in bf16 and fed to `tl.dot` with the matching 16 activation
  columns; the group's scale and zero point are applied once per tile,
  s * (sum a q - z * sum a), so per weight only shift, mask and a conversion remain.
- `dequant_mm`: one Triton pass writes the bf16 weight, then cuBLAS multiplies (for large M
  the unpack cost is spread over all rows).

Both take the package's tiled layout (packing.tile_rows) with 4-bit values, a group size
that is a multiple of the 128-row tile, and no act-order permutation (the common case).
Checked against dequantize-then-matmul; timed on the Llama-2-7B linear shapes.

    python benchmarks/w4a16_variants.py [--batch 1 16 64 256 2048]
Runs on CUDA; with TRITON_INTERPRET=1 on CPU it checks correctness only (small shapes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profile_decode import cuda_time  # noqa: E402

from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw  # noqa: E402
from pagedllm.model_executor.layers.quantization.packing import (  # noqa: E402
    dequantize,
    pack_cols,
    pack_rows,
    tile_rows,
)

TILE_K = 128  # 16 rows x 8 values per word (4-bit)


@triton.jit
def _plane_dot(a_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, M, N, K, group_size,
               stride_am, stride_ak, stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn,
               stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, TILE_K):
        qw = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                     mask=n_mask[None, :], other=0)
        s, z = tw._group_params(s_ptr, z_ptr, k0 // group_size, offs_n, n_mask,
                                stride_sg, stride_sn, stride_zg, stride_zn, 4, 0)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for j in tl.static_range(8):
            offs_k = k0 + j * 16 + offs_r
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            q = ((qw >> (j * 4)) & 15) | 0x4B000000
            w = (q.to(tl.float32, bitcast=True) - 8388608.0).to(a.dtype)  # 0..15, exact
            part += tl.dot(a, w)
            a_sum += tl.sum(a.to(tl.float32), axis=1)
        acc += s[None, :] * (part - a_sum[:, None] * z[None, :])
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_tiles(qw_ptr, s_ptr, z_ptr, w_ptr, N, K, group_size,
                   stride_qk, stride_qn, stride_sg, stride_sn, stride_zg, stride_zn, stride_wk, stride_wn,
                   BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * TILE_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    n_mask = offs_n < N
    qw = tl.load(qw_ptr + (k0 // 8 + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
                 mask=n_mask[None, :], other=0)
    s, z = tw._group_params(s_ptr, z_ptr, k0 // group_size, offs_n, n_mask,
                            stride_sg, stride_sn, stride_zg, stride_zn, 4, 0)
    for j in tl.static_range(8):
        q = ((qw >> (j * 4)) & 15) | 0x4B000000
        w = (q.to(tl.float32, bitcast=True) - (8388608.0 + z[None, :])) * s[None, :]
        rows = k0 + j * 16 + offs_r
        tl.store(w_ptr + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn, w.to(w_ptr.dtype.element_ty),
                 mask=(rows < K)[:, None] & n_mask[None, :])


def plane_dot(x, qweight, scales, qzeros, group_size, block_m=None, block_n=64):
    m, k = x.shape
    block_m = block_m or (16 if m <= 16 else 64)
    n = qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _plane_dot[grid](x, qweight, scales, qzeros, out, m, n, k, group_size, x.stride(0), x.stride(1),
                     qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
                     qzeros.stride(0), qzeros.stride(1), out.stride(0), out.stride(1),
                     BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=3)
    return out


def dequant_mm(x, qweight, scales, qzeros, group_size, block_n=128):
    k = x.shape[1]
    n = qweight.shape[1]
    w = torch.empty(k, n, dtype=x.dtype, device=x.device)
    _dequant_tiles[(triton.cdiv(n, block_n), triton.cdiv(k, TILE_K))](
        qweight, scales, qzeros, w, n, k, group_size, qweight.stride(0), qweight.stride(1),
        scales.stride(0), scales.stride(1), qzeros.stride(0), qzeros.stride(1), w.stride(0), w.stride(1),
        BLOCK_N=block_n, num_warps=4)
    return x @ w


def _layer(k: int, n: int, group_size: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group_size, n), generator=g)
    s = (torch.rand(k // group_size, n, generator=g) * 0.02 + 0.002).half()
    qw, qz = pack_rows(q, 4), pack_cols(z, 4)
    w = dequantize(qw, qz, s, group_size, 4, 0)  # [n, k] float32
    return tile_rows(qw, 4, TILE_K).to(device), s.to(device), qz.to(device), w.to(device)


def check(device: str, dtype: torch.dtype, shapes, batches) -> None:
    for k, n in shapes:
        qw, s, qz, w = _layer(k, n, 128, device, k + n)
        for m in batches:
            x = torch.randn(m, k, device=device).to(dtype)
            ref = x.double() @ w.double().t()
            for name, fn in (("plane_dot", plane_dot), ("dequant_mm", dequant_mm)):
                out = fn(x, qw, s, qz, 128)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                status = "ok" if err < (1e-2 if dtype == torch.bfloat16 else 2e-3) else "WRONG"
                print(f"check {name:10s} k={k} n={n} m={m}: rel err {err:.1e} {status}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    args = p.parse_args()
    if not torch.cuda.is_available():
        check("cpu", torch.float32, [(256, 96)], [1, 5, 17])
        return
    check("cuda", torch.bfloat16, [(4096, 4096), (11008, 4096)], [1, 16, 256])
    shapes = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]  # qkv, o, gate_up, down
    layers = [_layer(k, n, 128, "cuda", k + n) for k, n in shapes]
    dense = [w.to(torch.bfloat16).t().contiguous() for *_, w in layers]  # [k, n]
    print(f"{'batch':>6} {'bf16 ms':>9} {'package':>9} {'plane_dot':>10} {'dequant_mm':>11}  (one 7B layer's linears)")
    for m in args.batch:
        print(f"{m:6d} " + " ".join(f"{t:10.3f}" for t in _time_batch(m, shapes, layers, dense)))


def _time_batch(m: int, shapes, layers, dense) -> list[float]:
    """bf16, the package's kernel, plane_dot, dequant_mm: ms for one layer's four linears."""
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes]
    pairs = list(zip(xs, layers, strict=True))
    return [cuda_time(lambda: [x @ d for x, d in zip(xs, dense, strict=True)]),
            cuda_time(lambda: [tw.wna16_matmul(x, qw, s, qz, None, 128, 4, 0) for x, (qw, s, qz, _) in pairs]),
            cuda_time(lambda: [plane_dot(x, qw, s, qz, 128) for x, (qw, s, qz, _) in pairs]),
            cuda_time(lambda: [dequant_mm(x, qw, s, qz, 128) for x, (qw, s, qz, _) in pairs])]


if __name__ == "__main__":
    main()
