"""Attention logit soft-capping (Gemma 2: scores -> cap * tanh(score / cap)) in the Triton
paged-attention kernel, fast and batch-invariant launches, against the torch reference on
random paged batches (decodes, prefills with and without a cached prefix, GQA groups,
with and without a sliding window). Runs on CUDA, or on the CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch, paged_meta
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.attention.triton_backend import TritonInvariantAttention, TritonPagedAttention

CASES = [
    # (hq, hkv, dim, page, seqs, window)
    (8, 2, 64, 16, [(1, 5), (1, 64), (40, 40), (7, 100)], None),
    (4, 1, 32, 8, [(1, 33), (3, 3), (17, 50)], 12),
]


@pytest.mark.parametrize("backend", [TritonPagedAttention, TritonInvariantAttention],
                         ids=["fast", "batch-invariant"])
@pytest.mark.parametrize("case", CASES)
def test_triton_softcap_matches_torch(case, backend):
    hq, hkv, dim, page, seqs, window = case
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, dim, page,
                                                                       torch.float32, seed=5)
    q = q * 3  # scores of a few units: a cap of 2 bends them hard
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, backend.tile_q(hq // hkv), DEV)
    scale, cap = dim**-0.5, 2.0
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale,
                                      sliding_window=window, logits_soft_cap=cap)
    out = backend.forward(q, k, v, kc.clone(), vc.clone(), meta, scale, sliding_window=window,
                          logits_soft_cap=cap)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    plain = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale,
                                        sliding_window=window)
    assert not torch.allclose(plain, ref, atol=1e-2)  # the cap changed the result
