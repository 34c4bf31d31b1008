"""Bidirectional attention (embedding models with `is_causal: false`, gte-Qwen2) in the
Triton paged-attention kernel: whole inputs in one step, every query sees every key of its
sequence, against the torch reference; and the causal result differs. Runs on CUDA, or on
the CPU with TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from paged_batch import paged_batch, paged_meta
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.attention.triton_backend import TritonPagedAttention

CASES = [
    # (hq, hkv, dim, page, seqs): prefills only, each whole (q_len == ctx_len)
    (8, 2, 64, 16, [(40, 40), (7, 7), (100, 100)]),
    (4, 4, 32, 8, [(1, 1), (33, 33)]),
]


@pytest.mark.parametrize("case", CASES)
def test_triton_bidirectional_matches_torch(case):
    hq, hkv, dim, page, seqs = case
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(seqs, hq, hkv, dim, page,
                                                                       torch.float32, seed=3)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, TritonPagedAttention.tile_q(hq // hkv), DEV)
    scale = dim**-0.5
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale, causal=False)
    out = TritonPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale, causal=False)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    causal = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, scale)
    assert not torch.allclose(causal, ref, atol=1e-2)  # the direction changed the result
