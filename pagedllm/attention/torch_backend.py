"""Paged attention in plain PyTorch: correct on any device, the reference for faster ones.

Decode sequences are served together: their context is gathered from the block tables
into one padded tensor and masked by length, so a decode step costs one SDPA call per
layer whatever the batch size (two when the lengths are so mixed that padding the short
ones to the longest would waste a quarter of the gather). Prefill chunks are served one by one (few per step).

ALiBi models (Baichuan-13B) pass per-head slopes: the score of query i on key j gets
-m_h * (i - j) added after the 1/sqrt(d) scaling. Sliding-window layers (Mistral) pass the
window W: query i sees keys i - W + 1 .. i. Gemma 2 soft-caps the scaled scores,
cap * tanh(score / cap), before the mask: SDPA cannot, so those layers compute the scores
themselves (in float32, as transformers' eager attention). Attention sinks (gpt-oss) pass one
learned logit per head that joins each softmax's denominator and adds nothing to its
numerator: a zero key whose score is the sink (an additive mask column) with a zero value.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata

FP8_MAX = 448.0  # the largest finite e4m3 value


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in e4m3, saturated (e4m3fn has no infinity: out of range would be NaN)."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(pages: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache pages in the compute dtype: fp8 ones times their scale, others as they are."""
    if not is_fp8(pages):
        return pages
    out = pages.to(dtype)
    return out if scale == 1.0 else out * scale


def _decode_groups(meta: AttentionMetadata, block_size: int) -> list[tuple[torch.Tensor | None, int]]:
    """The decode sequences in at most two groups, each gathered and padded to its own
    longest context: with mixed lengths, padding everything to the longest one gathers and
    attends over up to twice the blocks (the gather is a fifth of a CPU decode step).
    (rows or None for all, blocks per row) pairs; planned once per step, shared by layers."""
    plan = getattr(meta, "_decode_plan", None)
    if plan is not None:
        return plan
    nd = meta.num_decode
    plan = []
    if nd:
        nblk = -(-meta.host_ctx_len[:nd].astype(np.int64) // block_size)
        order = np.argsort(nblk, kind="stable")
        sorted_blk = nblk[order]
        top = int(sorted_blk[-1])
        # Cost of splitting after the k shortest: k rows padded to the k-th length, the rest
        # to the longest; one split only, and only if it saves a quarter of the blocks.
        k = np.arange(1, nd)
        cost = k * sorted_blk[:-1] + (nd - k) * top
        best = int(np.argmin(cost)) if nd > 1 else -1
        if best >= 0 and cost[best] <= 0.75 * nd * top:
            cut = best + 1
            dev = meta.block_tables.device
            for part in (order[:cut], order[cut:]):
                plan.append((torch.from_numpy(part).to(dev), int(nblk[part].max())))
        else:
            plan.append((None, top))
    meta._decode_plan = plan
    return plan


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         gqa: bool, sinks: torch.Tensor | None = None, is_causal: bool = False,
         softcap: float | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, Lq, D] over k, v [B, Hkv, Lk, D]; `mask` is boolean (True:
    visible) or additive, `is_causal` aligns the last query with the last key. With `sinks`
    ([Hq] logits), each head's sink joins the softmax's denominator. With `softcap`, the
    scaled scores become cap * tanh(score / cap) before the mask: SDPA cannot, so the scores
    are computed here (in float32, as transformers' eager attention)."""
    if softcap is not None:
        return _softcapped(q, k, v, mask, scale, gqa, sinks, is_causal, softcap)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    # The sink as a zero key whose score is the mask column's value, with a zero value.
    b, hq, lq, dim = q.shape
    lk = k.shape[2]
    if is_causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is None:
        bias = q.new_zeros(1, 1, 1, lk)
    elif mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    else:
        bias = mask.to(q.dtype)
    bias = bias.expand(b, hq, lq, lk)
    sink = sinks.to(q.dtype).view(1, hq, 1, 1).expand(b, hq, lq, 1)
    zero = k.new_zeros(b, k.shape[1], 1, dim)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                          attn_mask=torch.cat([bias, sink], -1), scale=scale,
                                          enable_gqa=gqa)


def _softcapped(q, k, v, mask, scale: float, gqa: bool, sinks, is_causal: bool,
                softcap: float) -> torch.Tensor:
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if is_causal:
        lq, lk = s.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


class TorchPagedAttention:
    name = "torch"
    supports_alibi = True
    supports_softcap = True
    supports_bidirectional = True
    supports_sinks = True
    prefill_tile_q = 0  # no kernel tiles: the runner leaves prefill_tiles empty
    long_slots = True  # the KV cache is written by index_copy_, which takes int64 slots

    @staticmethod
    def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        heads, dim = k.shape[-2:]
        if is_fp8(k_cache):  # stored as x / scale in e4m3; index_copy_ has no fp8 kernel
            k = quantize_fp8(k, k_scale).view(torch.uint8)
            v = quantize_fp8(v, v_scale).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)

    @staticmethod
    def forward(
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        alibi_slopes: torch.Tensor | None = None,  # [Hq] float32, or None
        sliding_window: int | None = None,  # a query sees this many positions, itself included
        k_scale: float = 1.0,  # fp8 caches: the stored values are k / k_scale, v / v_scale
        v_scale: float = 1.0,
        logits_soft_cap: float | None = None,  # scores -> cap * tanh(score / cap) (Gemma 2)
        sinks: torch.Tensor | None = None,  # [Hq] logits that join each softmax's denominator
        causal: bool = True,  # False: a prompt's tokens all see each other (embedding models)
    ) -> torch.Tensor:
        TorchPagedAttention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        fp8 = is_fp8(k_cache)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        bs, hkv, dim = k_cache.shape[1:]
        nd = meta.num_decode
        for rows, nblk in _decode_groups(meta, bs):
            tables = meta.block_tables[:nd, :nblk] if rows is None else meta.block_tables.index_select(0, rows)[:, :nblk]
            ctx = meta.ctx_len[:nd] if rows is None else meta.ctx_len.index_select(0, rows)
            n = tables.shape[0]
            tables = tables.reshape(-1).long()
            # index_select gathers whole blocks faster than advanced indexing on CPU.
            kc = dequantize(k_cache.index_select(0, tables), k_scale, q.dtype)
            vc = dequantize(v_cache.index_select(0, tables), v_scale, q.dtype)
            kc = kc.view(n, nblk * bs, hkv, dim).transpose(1, 2)
            vc = vc.view(n, nblk * bs, hkv, dim).transpose(1, 2)
            pos = torch.arange(nblk * bs, device=q.device)
            visible = pos[None, :] < ctx[:, None]
            if sliding_window is not None:
                visible &= pos[None, :] >= ctx[:, None] - sliding_window
            mask = visible[:, None, None, :]
            if alibi_slopes is not None:
                dist = pos[None, :] - (ctx[:, None] - 1)  # j - i, <= 0 where valid
                bias = alibi_slopes[None, :, None, None] * dist[:, None, None, :].float()
                mask = bias.masked_fill(~mask, float("-inf")).to(q.dtype)
            qd = q[:nd] if rows is None else q.index_select(0, rows)
            o = sdpa(qd.unsqueeze(2), kc, vc, mask, scale, gqa, sinks, softcap=logits_soft_cap).squeeze(2)
            if rows is None:
                out[:nd] = o
            else:
                out.index_copy_(0, rows, o)
        for i in range(nd, meta.num_seqs):
            start, qlen, ctx = (int(meta.host_q_start[i]), int(meta.host_q_len[i]),
                                int(meta.host_ctx_len[i]))
            rows = slice(start, start + qlen)
            qs = q[rows].transpose(0, 1).unsqueeze(0)
            if ctx == qlen and not fp8:  # nothing cached before: attend to this chunk only
                ks, vs = k[rows], v[rows]
            else:  # (an fp8 cache: the chunk's keys as stored, as later steps will read them)
                table = meta.block_tables[i, : -(-ctx // bs)].long()
                ks = dequantize(k_cache.index_select(0, table), k_scale, q.dtype).view(-1, hkv, dim)[:ctx]
                vs = dequantize(v_cache.index_select(0, table), v_scale, q.dtype).view(-1, hkv, dim)[:ctx]
            ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            windowed = sliding_window is not None and sliding_window < ctx
            if not causal:
                if ctx != qlen:
                    raise RuntimeError("bidirectional attention reads an input whole in one step; "
                                       f"got {qlen} of {ctx} tokens")
                o = sdpa(qs, ks, vs, None, scale, gqa, sinks, softcap=logits_soft_cap)
            elif alibi_slopes is None and ctx == qlen and not windowed:
                o = sdpa(qs, ks, vs, None, scale, gqa, sinks, is_causal=True, softcap=logits_soft_cap)
            else:
                qpos = torch.arange(ctx - qlen, ctx, device=q.device)
                dist = torch.arange(ctx, device=q.device)[None, :] - qpos[:, None]
                if alibi_slopes is None:
                    mask = dist <= 0  # causal, offset by the cached prefix
                    if windowed:
                        mask &= dist > -sliding_window
                else:
                    mask = (alibi_slopes[:, None, None] * dist.float()).masked_fill(
                        dist > 0, float("-inf")).to(q.dtype).unsqueeze(0)
                o = sdpa(qs, ks, vs, mask, scale, gqa, sinks, softcap=logits_soft_cap)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out
