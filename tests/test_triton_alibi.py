"""ALiBi (Baichuan-13B) in the Triton paged-attention kernel against the torch backend,
on the random batches of test_triton_attention (decodes, prefills with and without a
cached prefix, GQA groups). Runs on CUDA, or on the CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from paged_batch import paged_batch as _batch  # noqa: E402
from paged_batch import paged_meta  # noqa: E402
from test_triton_attention import CASES, DEV  # noqa: E402  (skips without CUDA)

from pagedllm.attention.torch_backend import TorchPagedAttention  # noqa: E402
from pagedllm.attention.triton_backend import TritonPagedAttention  # noqa: E402
from pagedllm.model_executor.layers.rotary import alibi_slopes  # noqa: E402


@pytest.mark.parametrize("case", CASES)
def test_triton_alibi_matches_torch(case):
    hq, hkv, dim, page, seqs = case
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = _batch(seqs, hq, hkv, dim, page,
                                                                   torch.float32)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    slopes = alibi_slopes(hq).to(DEV) * 4  # steeper than real slopes: the bias must matter
    tile_q = TritonPagedAttention.tile_q(hq // hkv)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, tile_q, DEV)
    scale = dim**-0.5
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale,
                                      alibi_slopes=slopes)
    out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale,
                                       alibi_slopes=slopes)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    plain = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert not torch.allclose(plain, ref, atol=1e-2)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("window", [1, 5, 37])
def test_triton_sliding_window_matches_torch(case, window):
    """Sliding-window layers (Mistral): the kernel masks keys `window` or more positions back
    and skips the pages before them, as the torch backend masks them."""
    hq, hkv, dim, page, seqs = case
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = _batch(seqs, hq, hkv, dim, page,
                                                                   torch.float32)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(hq // hkv), DEV)
    scale = dim**-0.5
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale, sliding_window=window)
    out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale, sliding_window=window)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    if max(ctx) > window:  # the window cut something off
        plain = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
        assert not torch.allclose(plain, ref, atol=1e-3)
