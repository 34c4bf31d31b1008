"""Triton paged-attention kernels against the torch reference backend, on random inputs:
decodes, prefills with and without a cached prefix, GQA group sizes, head sizes, and
padding rows (slot -1) as CUDA-graph batches have them.

Runs on CUDA; with TRITON_INTERPRET=1 and Triton installed it also runs on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.attention.triton_backend import TritonPagedAttention


def _batch(seqs, hq, hkv, dim, page, dtype, seed=0):
    """seqs: list of (q_len, ctx_len). Decodes (q_len 1) must come first."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    total_blocks = sum(-(-c // page) for _, c in seqs) + 3
    perm = rng.permutation(total_blocks)  # scattered pages, as a real pool has them
    width = max(-(-c // page) for _, c in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    used = 0
    slots, q_start, rows = [], [], 0
    k_cache = torch.randn(total_blocks, page, hkv, dim, generator=g).to(dtype)
    v_cache = torch.randn(total_blocks, page, hkv, dim, generator=g).to(dtype)
    for i, (ql, ctx) in enumerate(seqs):
        nb = -(-ctx // page)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(ctx - ql, ctx)
        slots.extend((tables[i, pos // page].astype(np.int64) * page + pos % page).tolist())
        q_start.append(rows)
        rows += ql
    t = rows
    q = torch.randn(t, hq, dim, generator=g).to(dtype)
    k = torch.randn(t, hkv, dim, generator=g).to(dtype)
    v = torch.randn(t, hkv, dim, generator=g).to(dtype)
    ql = np.array([s[0] for s in seqs])
    ctx = np.array([s[1] for s in seqs])
    nd = int((ql == 1).sum())
    return q, k, v, k_cache, v_cache, tables, np.array(slots), np.array(q_start), ql, ctx, nd


def _meta(tables, slots, q_start, ql, ctx, nd, tile_q):
    def t(x):
        return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.int32, device=DEV)

    tiles = [(i, q0) for i in range(nd, len(ql)) for q0 in range(0, int(ql[i]), tile_q)]
    tiles_t = t(np.array(tiles, dtype=np.int64).T.reshape(2, -1)) if tiles else t(np.zeros((2, 0)))
    return AttentionMetadata(
        slot_mapping=torch.as_tensor(slots, device=DEV), num_decode=nd, block_tables=t(tables),
        q_start=t(q_start), q_len=t(ql), ctx_len=t(ctx), prefill_tiles=tiles_t,
        num_prefill_tiles=len(tiles), prefill_tile_q=tile_q,
        host_q_start=q_start, host_q_len=ql, host_ctx_len=ctx)


CASES = [
    # (hq, hkv, dim, page, seqs)
    (8, 8, 64, 16, [(1, 1), (1, 17), (1, 300)]),
    (8, 2, 64, 16, [(1, 5), (1, 64), (40, 40), (7, 100)]),
    (9, 3, 64, 16, [(1, 33), (20, 20), (5, 70)]),  # SmolLM2's group of 3
    (16, 8, 128, 16, [(130, 130), (64, 200), (1, 129)][::-1]),
    (4, 1, 32, 8, [(3, 3), (17, 50)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_torch(case, dtype):
    hq, hkv, dim, page, seqs = case
    seqs = sorted(seqs, key=lambda s: s[0] != 1)
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = _batch(seqs, hq, hkv, dim, page, dtype)
    q, k, v, kc, vc = (x.to(DEV) for x in (q, k, v, kc, vc))
    kc2, vc2 = kc.clone(), vc.clone()
    scale = dim**-0.5
    tile_q = TritonPagedAttention.tile_q(hq // hkv)
    ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), kc.float(), vc.float(),
                                      _meta(tables, slots, q_start, ql, ctx, nd, tile_q), scale)
    out = TritonPagedAttention.forward(q, k, v, kc2, vc2, _meta(tables, slots, q_start, ql, ctx, nd, tile_q), scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # The cache write landed where the reference put it.
    kc_ref = kc.clone()
    TorchPagedAttention.write_kv(k, v, kc_ref, vc.clone(), torch.as_tensor(slots, device=DEV))
    torch.testing.assert_close(kc2, kc_ref)


def test_padding_rows_write_nothing():
    kc = torch.zeros(4, 8, 2, 32, device=DEV)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 2, 32, device=DEV)
    slots = torch.tensor([5, -1, 9], device=DEV, dtype=torch.int32)
    TritonPagedAttention.write_kv(k, k, kc, vc, slots)
    flat = kc.view(-1, 2, 32)
    assert flat[5].eq(1).all() and flat[9].eq(1).all()
    assert flat.sum() == 2 * 64
