"""Paged attention whose result for a query does not depend on the batch, the chunking of
its prompt or what the prefix cache held (engine option `batch_invariant`).

Every query, whether a decode, a row of a prefill chunk or the first token after a cached
prefix, is computed by the same procedure: queries go in tiles of `TILE_Q` rows (the
query heads sharing a KV head stacked, so a tile is one fixed-shape matrix), keys in
pages of `PAGE` absolute positions (0..PAGE-1, PAGE..2*PAGE-1, ...), and each page adds to
an online softmax (running max, sum and weighted values) in page order. Every matmul has
the same shape whatever the batch, so it runs the same kernel (see
pagedllm/batch_invariant.py), and a page a query cannot see changes nothing
bit for bit (its weights are exp(-inf) = 0, its running max stays), so which pages a tile
happens to walk makes no difference to any of its rows.

It costs more than the fast backends (a decode pads its one query to a tile); that is the
price of the guarantee, measured in benchmarks/results.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchPagedAttention, dequantize
from pagedllm.batch_invariant import bmm, elementwise

TILE_Q = 4  # small: a decode pads its one query to a tile
PAGE = 64


class _Plan:
    """The step's tiles and pages, the same for every layer: planned once per step."""

    def __init__(self, meta: AttentionMetadata, block_size: int, group: int, window: int | None,
                 dev: torch.device):
        q_start = torch.as_tensor(meta.host_q_start, dtype=torch.long)
        q_len = torch.as_tensor(meta.host_q_len, dtype=torch.long)
        ctx = torch.as_tensor(meta.host_ctx_len, dtype=torch.long)
        # Tiles: (sequence, first query of the tile within the sequence's chunk).
        counts = -(-q_len // TILE_Q)
        seq = torch.repeat_interleave(torch.arange(len(q_len)), counts)
        first = torch.cumsum(counts, 0) - counts
        within = (torch.arange(int(counts.sum())) - first[seq]) * TILE_Q
        r = within[:, None] + torch.arange(TILE_Q)[None, :]  # [nt, TILE_Q] query index
        real = r < q_len[seq][:, None]
        qpos = torch.where(real, ctx[seq][:, None] - q_len[seq][:, None] + r, -1)
        rows = torch.where(real, q_start[seq][:, None] + r, 0)
        # Pages a tile walks: up to its last query's position (causal), from the window's
        # start for sliding-window layers.
        last = qpos.max(1).values
        hi = last // PAGE + 1
        if window is not None:
            lo = torch.clamp(torch.where(real, qpos, last[:, None]).min(1).values - window + 1,
                             min=0) // PAGE
        else:
            lo = torch.zeros_like(hi)
        self.num_tiles = nt = len(seq)
        self.rows = rows.to(dev).view(-1)
        self.keep = real.to(dev).view(-1)
        # A tile's rows stacked per KV head: group heads x TILE_Q queries.
        qrow = qpos[:, None, :].expand(nt, group, TILE_Q).reshape(nt, 1, group * TILE_Q)
        seq_ctx = ctx[seq]
        tables = meta.block_tables.long().cpu()
        offs = torch.arange(PAGE)
        self.pages = []  # (tiles or None for all, slots [ns * PAGE], key valid, visible, dist)
        for page in range(int(lo.min()), int(hi.max())):
            sel = ((lo <= page) & (page < hi)).nonzero().squeeze(1)
            if len(sel) == 0:
                continue
            kpos = page * PAGE + offs
            blk = torch.clamp(kpos // block_size, max=tables.shape[1] - 1)
            kvalid = kpos[None, :] < seq_ctx[sel][:, None]  # [ns, PAGE]
            slots = tables[seq[sel]][:, blk] * block_size + (kpos % block_size)[None, :]
            slots = torch.where(kvalid, slots, 0)
            qr = qrow[sel]  # [ns, 1, G*TQ]
            dist = kpos[None, None, None, :] - qr[..., None]  # key - query: <= 0 is visible
            visible = (dist <= 0) & (qr[..., None] >= 0) & kvalid[:, None, None, :]
            if window is not None:
                visible &= dist > -window
            everyone = len(sel) == nt
            self.pages.append((None if everyone else sel.to(dev), slots.view(-1).to(dev),
                               kvalid.to(dev), visible.to(dev), dist.float().to(dev)))


class BatchInvariantAttention:
    name = "batch_invariant"
    supports_alibi = True
    supports_softcap = True
    supports_sinks = True
    prefill_tile_q = 0
    long_slots = True  # the KV cache is written by index_copy_, which takes int64 slots

    write_kv = staticmethod(TorchPagedAttention.write_kv)

    @staticmethod
    def forward(
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        alibi_slopes: torch.Tensor | None = None,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        logits_soft_cap: float | None = None,  # scores -> cap * tanh(score / cap) (Gemma 2)
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        TorchPagedAttention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        dev = q.device
        hq, dim = q.shape[1:]
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        group = hq // hkv
        plans = meta.__dict__.setdefault("_invariant_plans", {})
        plan = plans.get(sliding_window)
        if plan is None:
            plan = plans[sliding_window] = _Plan(meta, bs, group, sliding_window, dev)
        nt, rows = plan.num_tiles, group * TILE_Q
        # [nt, TILE_Q, Hkv, group, D] -> [nt, Hkv, group * TILE_Q, D]: one matrix per KV head.
        qt = q.float().index_select(0, plan.rows).view(nt, TILE_Q, hkv, group, dim)
        qt = qt.permute(0, 2, 3, 1, 4).reshape(nt, hkv, rows, dim)
        if sinks is None:
            m = torch.full((nt, hkv, rows), float("-inf"), device=dev)
            l_sum = torch.zeros((nt, hkv, rows), device=dev)
        else:  # a row starts at its head's sink logit, weight exp(0) = 1, value zero
            m = sinks.float().view(hkv, group, 1).expand(hkv, group, TILE_Q).reshape(1, hkv, rows)
            m = m.expand(nt, hkv, rows).clone()
            l_sum = torch.ones((nt, hkv, rows), device=dev)
        acc = torch.zeros((nt, hkv, rows, dim), device=dev)
        slopes = None
        if alibi_slopes is not None:  # [Hq] -> per stacked row [Hkv, group * TILE_Q, 1]
            slopes = alibi_slopes.float().view(hkv, group, 1).expand(hkv, group, TILE_Q).reshape(hkv, rows, 1)
        k_flat = k_cache.view(-1, hkv, dim)
        v_flat = v_cache.view(-1, hkv, dim)
        for sel, slots, kvalid, visible, dist in plan.pages:
            ns = nt if sel is None else len(sel)
            kp = dequantize(k_flat.index_select(0, slots), k_scale, torch.float32).float()
            vp = dequantize(v_flat.index_select(0, slots), v_scale, torch.float32).float()
            kp, vp = kp.view(ns, PAGE, hkv, dim), vp.view(ns, PAGE, hkv, dim)
            vp = torch.where(kvalid[:, :, None, None], vp, 0.0)  # unwritten slots may hold NaN
            vp = torch.cat([vp, torch.ones_like(vp[..., :1])], dim=-1)
            qs = qt if sel is None else qt.index_select(0, sel)
            s = bmm(qs.reshape(ns * hkv, rows, dim), kp.permute(0, 2, 3, 1).reshape(ns * hkv, dim, PAGE))
            s = s.view(ns, hkv, rows, PAGE) * scale
            if logits_soft_cap is not None:
                s = elementwise(torch.tanh, s / logits_soft_cap) * logits_soft_cap
            if slopes is not None:
                s = s + slopes * dist
            s = s.masked_fill(~visible, float("-inf"))
            m_old = m if sel is None else m.index_select(0, sel)
            m_new = torch.maximum(m_old, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = elementwise(torch.exp, m_old - m_safe)
            p = elementwise(torch.exp, s - m_safe[..., None])
            # p @ [V | 1]: the weighted values and, in the last column, the weights' sum, both
            # by the fixed-order product (a CUDA sum's order changes with the tensor's size).
            pv = bmm(p.reshape(ns * hkv, rows, PAGE),
                     vp.permute(0, 2, 1, 3).reshape(ns * hkv, PAGE, dim + 1)).view(ns, hkv, rows, dim + 1)
            if sel is None:
                l_sum = l_sum * alpha + pv[..., dim]
                acc = acc * alpha[..., None] + pv[..., :dim]
                m = m_new
            else:
                l_sum[sel] = l_sum.index_select(0, sel) * alpha + pv[..., dim]
                acc[sel] = acc.index_select(0, sel) * alpha[..., None] + pv[..., :dim]
                m[sel] = m_new
        o = acc / l_sum[..., None]  # padded rows (nothing visible, no sink) are NaN and dropped
        o = o.view(nt, hkv, group, TILE_Q, dim).permute(0, 3, 1, 2, 4).reshape(nt * TILE_Q, hq, dim)
        out = torch.empty_like(q)
        out.index_copy_(0, plan.rows[plan.keep], o[plan.keep].to(q.dtype))
        return out
