"""The CPU attention backend's decode path against naive attention, one sequence at a
time: with uniform context lengths (one padded group) and mixed ones (two groups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchPagedAttention, _decode_groups


@pytest.mark.parametrize("lengths, groups", [([50, 52, 49, 61], 1), ([5, 7, 300, 9, 310, 6, 12], 2)])
def test_decode_groups_equal_naive_attention(lengths, groups):
    g = torch.Generator().manual_seed(len(lengths))
    bs, hkv, hq, d = 16, 2, 4, 32
    nb = 128
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    n = len(lengths)
    width = max(-(-c // bs) for c in lengths)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(n, width, dtype=torch.int32)
    used = 0
    for i, c in enumerate(lengths):
        blocks = -(-c // bs)
        tables[i, :blocks] = perm[used : used + blocks]
        used += blocks
    ctx = np.asarray(lengths, dtype=np.int32)
    # The new token of each sequence is its last context position (written by forward).
    slots = torch.tensor([int(tables[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(lengths)])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode=n, block_tables=tables, q_start=torch.arange(n, dtype=torch.int32),
        q_len=torch.ones(n, dtype=torch.int32), ctx_len=torch.from_numpy(ctx),
        host_q_start=np.arange(n), host_q_len=np.ones(n, dtype=np.int64), host_ctx_len=ctx)
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    out = TorchPagedAttention.forward(q, k, v, k_cache, v_cache, meta, scale=d ** -0.5)
    assert len(_decode_groups(meta, bs)) == groups
    for i, c in enumerate(lengths):
        rows = torch.cat([torch.arange(int(b) * bs, int(b) * bs + bs) for b in tables[i, : -(-c // bs)]])[:c]
        ks = k_cache.view(-1, hkv, d)[rows].repeat_interleave(hq // hkv, dim=1)  # [c, hq, d]
        vs = v_cache.view(-1, hkv, d)[rows].repeat_interleave(hq // hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,chd->hc", q[i], ks) * d ** -0.5, dim=-1)
        ref = torch.einsum("hc,chd->hd", w, vs)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)
