"""A flat batch over a paged KV cache for attention tests: random queries, keys and values,
scattered pages, and the metadata the model runner would build."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata


def paged_batch(seqs, hq, hkv, dim, page, dtype, seed=0):
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


def paged_meta(tables, slots, q_start, ql, ctx, nd, tile_q, device="cpu"):
    def t(x):
        return torch.as_tensor(np.ascontiguousarray(x), dtype=torch.int32, device=device)

    tiles = [(i, q0) for i in range(nd, len(ql)) for q0 in range(0, int(ql[i]), tile_q)]
    tiles_t = t(np.array(tiles, dtype=np.int64).T.reshape(2, -1)) if tiles else t(np.zeros((2, 0)))
    return AttentionMetadata(
        slot_mapping=torch.as_tensor(slots, device=device), num_decode=nd, block_tables=t(tables),
        q_start=t(q_start), q_len=t(ql), ctx_len=t(ctx), prefill_tiles=tiles_t,
        num_prefill_tiles=len(tiles), prefill_tile_q=tile_q,
        host_q_start=q_start, host_q_len=ql, host_ctx_len=ctx)


def latent_batch(seqs, heads, rank, rope, page, dtype, seed=0):
    """Random multi-head latent attention inputs (attention/mla.py) over scattered latent
    pages of rank + rope values a token; seqs: (q_len, ctx_len), decodes first."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    total = sum(-(-c // page) for _, c in seqs) + 2
    perm = rng.permutation(total)
    tables = np.zeros((len(seqs), max(-(-c // page) for _, c in seqs)), dtype=np.int32)
    slots, q_start, rows, used = [], [], 0, 0
    for i, (ql, ctx) in enumerate(seqs):
        nb = -(-ctx // page)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(ctx - ql, ctx)
        slots += (tables[i, pos // page].astype(np.int64) * page + pos % page).tolist()
        q_start.append(rows)
        rows += ql
    cache = torch.randn(total, page, rank + rope, generator=g).to(dtype)
    dn, dv = 16, 12
    args = dict(q_nope=torch.randn(rows, heads, dn, generator=g).to(dtype),
                q_pe=torch.randn(rows, heads, rope, generator=g).to(dtype),
                latent=torch.randn(rows, rank + rope, generator=g).to(dtype),
                w_uk=(0.2 * torch.randn(heads, dn, rank, generator=g)).to(dtype),
                w_uv=(0.2 * torch.randn(heads, dv, rank, generator=g)).to(dtype))
    ql = np.array([s[0] for s in seqs])
    ctx = np.array([s[1] for s in seqs])
    return cache, args, (tables, np.array(slots), np.array(q_start), ql, ctx)
