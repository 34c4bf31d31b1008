"""Paged attention whose result for a query does not depend on the batch, the chunking of
its prompt or what the prefix cache held (engine option `batch_invariant`).

Every query, whether a decode, a row of a prefill chunk or the first token after a cached
prefix, is computed by the same procedure: queries go in tiles of `TILE_Q` rows (the
query heads sharing a KV head stacked, so a tile is one fixed-shape matrix), keys in
pages of `PAGE` absolute positions (0..PAGE-1, PAGE..2*PAGE-1, ...), and each page adds to
an online softmax (running max, sum and weighted values) in page order. Every matmul has
the same shape whatever the batch, so it runs the same kernel (see
model_executor/layers/batch_invariant.py), and a page a query cannot see changes nothing
bit for bit (its weights are exp(-inf) = 0, its running max stays), so which pages a tile
happens to walk makes no difference to any of its rows.

It costs more than the fast backends (a decode pads its one query to a tile); that is the
price of the guarantee, measured in benchmarks/results.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.model_executor.layers.batch_invariant import elementwise

TILE_Q = 16
PAGE = 64


class BatchInvariantAttention:
    name = "batch_invariant"
    supports_alibi = True
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
    ) -> torch.Tensor:
        TorchPagedAttention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        dev = q.device
        hq, dim = q.shape[1:]
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        group = hq // hkv
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
        tile_ctx = ctx[seq]
        # Pages a tile walks: up to its last query's position (causal), from the window's
        # start for sliding-window layers.
        last = qpos.max(1).values
        hi = last // PAGE + 1
        if sliding_window is not None:
            lo = torch.clamp(torch.where(real, qpos, last[:, None]).min(1).values
                             - sliding_window + 1, min=0) // PAGE
        else:
            lo = torch.zeros_like(hi)
        nt = len(seq)
        qpos_d, rows_d = qpos.to(dev), rows.to(dev)
        seq_d, ctx_d = seq.to(dev), tile_ctx.to(dev)
        # [nt, TILE_Q, Hkv, group, D] -> [nt, Hkv, group * TILE_Q, D]: one matrix per KV head.
        qt = q.float().index_select(0, rows_d.view(-1)).view(nt, TILE_Q, hkv, group, dim)
        qt = qt.permute(0, 2, 3, 1, 4).reshape(nt, hkv, group * TILE_Q, dim)
        qrow = qpos_d[:, None, None, :].expand(nt, hkv, group, TILE_Q).reshape(nt, hkv, -1)
        m = torch.full((nt, hkv, group * TILE_Q), float("-inf"), device=dev)
        l_sum = torch.zeros((nt, hkv, group * TILE_Q), device=dev)
        acc = torch.zeros((nt, hkv, group * TILE_Q, dim), device=dev)
        slopes = None
        if alibi_slopes is not None:  # [Hq] -> per stacked row [Hkv, group * TILE_Q]
            slopes = alibi_slopes.float().view(hkv, group, 1).expand(hkv, group, TILE_Q).reshape(hkv, -1)
        k_flat = k_cache.view(-1, hkv, dim)
        v_flat = v_cache.view(-1, hkv, dim)
        tables = meta.block_tables.long()
        offs = torch.arange(PAGE, device=dev)
        for page in range(int(lo.min()), int(hi.max())):
            sel = ((lo <= page) & (page < hi)).nonzero().squeeze(1)
            if len(sel) == 0:
                continue
            sel_d = sel.to(dev)
            kpos = page * PAGE + offs  # [PAGE]
            blk = torch.clamp(kpos // bs, max=tables.shape[1] - 1)
            slots = tables[seq_d[sel_d]][:, blk] * bs + (kpos % bs)[None, :]  # [ns, PAGE]
            kvalid = kpos[None, :] < ctx_d[sel_d][:, None]
            slots = torch.where(kvalid, slots, 0)
            kp = k_flat.index_select(0, slots.view(-1)).float().view(len(sel), PAGE, hkv, dim)
            vp = v_flat.index_select(0, slots.view(-1)).float().view(len(sel), PAGE, hkv, dim)
            vp = torch.where(kvalid[:, :, None, None], vp, 0.0)  # unwritten slots may hold NaN
            ns = len(sel)
            s = torch.bmm(qt[sel_d].reshape(ns * hkv, -1, dim),
                          kp.permute(0, 2, 3, 1).reshape(ns * hkv, dim, PAGE))
            s = s.view(ns, hkv, -1, PAGE) * scale
            qr = qrow[sel_d]  # [ns, Hkv, G*TQ]
            dist = kpos[None, None, None, :] - qr[..., None]  # key - query, <= 0 visible
            visible = (dist <= 0) & (qr[..., None] >= 0) & kvalid[:, None, None, :]
            if sliding_window is not None:
                visible &= dist > -sliding_window
            if slopes is not None:
                s = s + slopes[None, :, :, None] * dist.float()
            s = s.masked_fill(~visible, float("-inf"))
            m_old = m[sel_d]
            m_new = torch.maximum(m_old, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = elementwise(torch.exp, m_old - m_safe)
            p = elementwise(torch.exp, s - m_safe[..., None])
            l_sum[sel_d] = l_sum[sel_d] * alpha + p.sum(-1)
            pv = torch.bmm(p.reshape(ns * hkv, -1, PAGE),
                           vp.permute(0, 2, 1, 3).reshape(ns * hkv, PAGE, dim)).view(ns, hkv, -1, dim)
            acc[sel_d] = acc[sel_d] * alpha[..., None] + pv
            m[sel_d] = m_new
        o = acc / l_sum[..., None]  # padded rows (nothing visible) are NaN and dropped
        o = o.view(nt, hkv, group, TILE_Q, dim).permute(0, 3, 1, 2, 4).reshape(nt * TILE_Q, hq, dim)
        out = torch.empty_like(q)
        keep = real.view(-1).to(dev)
        out.index_copy_(0, rows_d.view(-1)[keep], o[keep].to(q.dtype))
        return out
