"""The W4A16 kernel's reference: random packed layers and dequantize-then-matmul in float64.

Shared by the kernel tests on CUDA (test_quantization_gpu.py) and the small ones that also
run in Triton's CPU interpreter (test_w4a16_kernels.py)."""

from __future__ import annotations

import torch

from pagedllm.model_executor.layers.quantization.packing import (
    dequantize,
    pack_cols,
    pack_rows,
    tile_rows,
)


def random_layer(k: int, n: int, group_size: int, bits: int, zero_offset: int, act_order: bool, seed: int,
                 device: str = "cuda"):
    """Random internal-layout tensors (fresh values per case, never zeros)."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    groups = -(-k // gs)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    z = torch.randint(0, (1 << bits) - zero_offset, (groups, n), generator=g)
    s = (torch.rand(groups, n, generator=g) * 0.02 + 0.002).half()
    perm = torch.randperm(k, generator=g).to(torch.int32) if act_order else None
    t = dict(qweight=pack_rows(q, bits), qzeros=pack_cols(z, bits), scales=s, perm=perm)
    return {key: v.to(device) if v is not None else None for key, v in t.items()}, gs


def check_kernel(m: int, k: int, n: int, group_size: int, act_order: bool, bits: int = 4, zero_offset: int = 1,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cuda",
                 config: dict | None = None) -> None:
    """wna16_matmul (the built-in kernel choice, or `config`) equals the dequantized weight's
    product, to the activations' precision."""
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    t, gs = random_layer(k, n, group_size, bits, zero_offset, act_order, seed, device)
    w = dequantize(t["qweight"], t["qzeros"], t["scales"], gs, bits, zero_offset, t["perm"])  # fp32 [n, k]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)
    ref = x.double() @ w.double().t()
    tiled = tile_rows(t["qweight"], bits, tw.tile_k_for(bits))
    out = tw.wna16_matmul(x, tiled, t["scales"], t["qzeros"], t["perm"], gs, bits, zero_offset, config)
    assert out.dtype == dtype and out.shape == (m, n)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err < tol, f"relative error {err:.2e}"
