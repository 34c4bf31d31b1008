"""Fused CUDA kernels against the PyTorch expressions they replace. GPU-marked; with
TRITON_INTERPRET=1 and Triton installed they can also be checked on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.model_executor.layers import fused_ops
from pagedllm.model_executor.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def _ref_rms(x, w, eps, residual=None):
    if residual is not None:
        x = x + residual
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return w * h, x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 4096])
def test_rms_norm_with_and_without_residual(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g).to(DEV, dtype)
    r = torch.randn(9, n, generator=g).to(DEV, dtype)
    w = torch.randn(n, generator=g).to(DEV, dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    ref_y, ref_r = _ref_rms(x, w, 1e-6, r)
    r2 = r.clone()
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6, r2), ref_y, **tol)
    torch.testing.assert_close(r2, ref_r, **tol)
    torch.testing.assert_close(fused_ops.rms_norm(x, w, 1e-6), _ref_rms(x, w, 1e-6)[0], **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_head_norm_reads_a_strided_view(dtype, tokens):
    """Per-head q / k norms (Qwen3) on the heads' view inside a fused qkv output: the
    kernel reads the strides (no copy) and takes several rows a program, including a
    last program with fewer rows than it holds."""
    g = torch.Generator().manual_seed(tokens)
    heads, kv, dim = 6, 2, 128
    qkv = torch.randn(tokens, (heads + 2 * kv) * dim, generator=g).to(DEV, dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv) * dim].view(tokens, kv, dim)
    assert tokens == 1 or not q.is_contiguous()
    w = torch.randn(dim, generator=g).to(DEV, dtype)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    before = qkv.clone()
    for x in (q, k):
        got = fused_ops.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape
        torch.testing.assert_close(got, _ref_rms(x.contiguous(), w, 1e-6)[0], **tol)
    assert torch.equal(qkv, before)  # read only
    wide = torch.randn(dim, tokens + 1, generator=g).to(DEV, dtype).t()  # last dim strided
    torch.testing.assert_close(fused_ops.rms_norm(wide, w, 1e-6), _ref_rms(wide.contiguous(), w, 1e-6)[0], **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 2304])
def test_gemma_rms_norm_matches_transformers(dtype, n):
    """Gemma's (1 + w) norm, scaled in float32 before the cast, as transformers' Gemma2RMSNorm."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g).to(DEV, dtype)
    r = torch.randn(9, n, generator=g).to(DEV, dtype)
    ref = Gemma2RMSNorm(n, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, generator=g).mul(0.5))
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused_ops.rms_norm(x, ref.weight, 1e-6, gemma=True), ref(x), **tol)
        r2 = r.clone()
        torch.testing.assert_close(fused_ops.rms_norm(x, ref.weight, 1e-6, r2, gemma=True), ref(x + r), **tol)
        torch.testing.assert_close(r2, x + r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,dim,rot", [(32, 32, 128, 128), (16, 8, 128, 128), (9, 3, 64, 64), (4, 2, 64, 32)])
def test_rotary_in_place_matches_reference(dtype, hq, hkv, dim, rot):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hq * dim, num_attention_heads=hq, rope_theta=10000.0)
    emb = RotaryEmbedding(cfg, dim, rot, 512)
    emb.build_tables(torch.device(DEV))
    t = 11
    qkv = torch.randn(t, (hq + 2 * hkv) * dim).to(DEV, dtype)
    q = qkv[:, : hq * dim].view(t, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(t, hkv, dim)
    pos = torch.randint(0, 512, (t,), dtype=torch.int32).to(DEV)
    cos, sin = emb.cos[pos.long()].unsqueeze(1), emb.sin[pos.long()].unsqueeze(1)
    ref_q, ref_k = emb._rotate(q.clone(), cos, sin), emb._rotate(k.clone(), cos, sin)
    fused_ops.rotary_(q, k, pos, emb.cos, emb.sin)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,dim", [(16, 8, 128), (9, 3, 64)])
def test_rotary_with_fused_head_norm(hq, hkv, dim, dtype, gemma):
    """q_norm / k_norm (RMSNorm of each head) fused into the rotary kernel: the same values
    as the norm modules' own kernel followed by the rotation, in place in the qkv output."""
    from transformers import LlamaConfig

    from pagedllm.model_executor.layers.norm import RMSNorm

    cfg = LlamaConfig(hidden_size=hq * dim, num_attention_heads=hq, rope_theta=10000.0)
    emb = RotaryEmbedding(cfg, dim, dim, 512)
    emb.build_tables(torch.device(DEV))
    g = torch.Generator().manual_seed(dim + gemma)
    t = 13
    qkv = torch.randn(t, (hq + 2 * hkv) * dim, generator=g).mul(3).to(DEV, dtype)
    q = qkv[:, : hq * dim].view(t, hq, dim)
    k = qkv[:, hq * dim : (hq + hkv) * dim].view(t, hkv, dim)
    v_before = qkv[:, (hq + hkv) * dim :].clone()
    norms = []
    for _ in range(2):
        n = RMSNorm(dim, 1e-6, gemma=gemma).to(DEV, dtype)
        with torch.no_grad():
            n.weight.copy_(torch.randn(dim, generator=g).mul(0.5))
        norms.append(n)
    pos = torch.randint(0, 512, (t,), dtype=torch.int32, generator=g).to(DEV)
    cos, sin = emb.cos[pos.long()].unsqueeze(1), emb.sin[pos.long()].unsqueeze(1)
    with torch.no_grad():
        ref_q = emb._rotate(fused_ops.rms_norm(q, norms[0].weight, 1e-6, gemma=gemma), cos, sin)
        ref_k = emb._rotate(fused_ops.rms_norm(k, norms[1].weight, 1e-6, gemma=gemma), cos, sin)
        assert emb.can_fuse_norm(q) == (DEV == "cuda")
        fused_ops.rotary_(q, k, pos, emb.cos, emb.sin, (norms[0].weight, norms[1].weight, 1e-6, gemma))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k, ref_k, **tol)
    assert torch.equal(qkv[:, (hq + hkv) * dim :], v_before)


def test_fused_head_norm_needs_the_whole_head_rotated():
    cos = torch.zeros(4, 16, device=DEV)
    q, k = torch.zeros(2, 2, 64, device=DEV), torch.zeros(2, 1, 64, device=DEV)
    w = torch.ones(64, device=DEV)
    with pytest.raises(ValueError, match="whole head"):
        fused_ops.rotary_(q, k, torch.zeros(2, dtype=torch.int32, device=DEV), cos, cos, (w, w, 1e-6, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [40, 1536, 11008])
def test_silu_and_mul(dtype, n):
    x = torch.randn(5, 2 * n).to(DEV, dtype)
    ref = F.silu(x[:, :n].float()).to(dtype) * x[:, n:]
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_ops.silu_and_mul(x), ref, **tol)
