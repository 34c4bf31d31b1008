"""Multi-head latent attention (DeepSeek-V2/V3) over latent pages, in plain PyTorch: the
reference on any device.

A layer's pages hold, per token, the normalised KV latent c (kv_lora_rank values) and the
rotated shared rope key k_pe (qk_rope_head_dim values): one vector for all heads, instead
of K and V per head. Head h's key is [W_UK[h] c, k_pe] and its value W_UV[h] c, with
W_UK / W_UV the two halves of the layer's kv_b_proj.

- Prefill chunks decompress: the latents of the chunk's whole context (cached prefix
  and the chunk) are up-projected into per-head keys and values, then causal attention
  as usual. The work is proportional to the chunk's context, once per chunk.
- Decodes use the absorbed form: W_UK folds into the query (q_lat[h] = W_UK[h]^T q_nope[h],
  kv_lora_rank wide), the scores are q_lat . c + q_pe . k_pe straight over the pages,
  the softmax-weighted sum of latents is taken, and W_UV is applied once to that sum.
  Nothing per head is ever materialised for the context, which is what makes MLA decode
  cheap: one latent read per cached token, shared by every head.

An fp8 cache stores the latent in e4m3 with scale 1 (no checkpoint ships MLA scales).

With `kernels` (the engine runs the Triton attention backend) and a CUDA cache, the latent
write and the decodes run in Triton (attention/mla_triton.py): nothing then reads the host
for a decode-only step, which CUDA graphs capture. Prefill chunks stay in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention import mla_triton
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import _decode_groups, dequantize, is_fp8, quantize_fp8


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, W] into cache [blocks, block_size, W] at the step's slots."""
    width = cache.shape[-1]
    if is_fp8(cache):  # index_copy_ has no fp8 kernel: copy the bytes
        latent = quantize_fp8(latent, 1.0).view(torch.uint8)
        cache = cache.view(torch.uint8)
    cache.view(-1, width).index_copy_(0, slot_mapping.long(), latent.to(cache.dtype))


def mla_forward(
    q_nope: torch.Tensor,  # [T, H, dn]
    q_pe: torch.Tensor,  # [T, H, dr], rotated
    latent: torch.Tensor,  # [T, r + dr]: normalised c then rotated k_pe, this step's tokens
    cache: torch.Tensor,  # [blocks, block_size, r + dr]
    meta: AttentionMetadata,
    scale: float,
    w_uk: torch.Tensor,  # [H, dn, r]
    w_uv: torch.Tensor,  # [H, dv, r]
    kernels: bool = False,  # Triton for the write and the decodes, on CUDA
) -> torch.Tensor:
    """Attention output [T, H, dv] (before o_proj); writes the step's latents first."""
    kernels = kernels and mla_triton.available(cache)
    (mla_triton.write_latent if kernels else write_latent)(latent, cache, meta.slot_mapping)
    heads, dv, rank = w_uv.shape
    out = q_nope.new_empty(q_nope.shape[0], heads, dv)
    nd = meta.num_decode
    if nd:
        out[:nd] = _decode_absorbed(q_nope[:nd], q_pe[:nd], cache, meta, scale, w_uk, w_uv, kernels)
    bs = cache.shape[1]
    for i in range(nd, meta.num_seqs):
        start, qlen, ctx = (int(meta.host_q_start[i]), int(meta.host_q_len[i]), int(meta.host_ctx_len[i]))
        rows = slice(start, start + qlen)
        if ctx == qlen and not is_fp8(cache):  # nothing cached before: this chunk's latents
            kv = latent[rows]
        else:  # the cached prefix and the chunk, as stored (and as later steps read them)
            table = meta.block_tables[i, : -(-ctx // bs)].long()
            kv = dequantize(cache.index_select(0, table), 1.0, q_nope.dtype).view(-1, cache.shape[-1])[:ctx]
        c, k_pe = kv[:, :rank], kv[:, rank:]
        k_nope = torch.einsum("tr,hdr->htd", c, w_uk)  # decompressed: [H, ctx, dn]
        v = torch.einsum("tr,hvr->htv", c, w_uv)  # [H, ctx, dv]
        k = torch.cat((k_nope, k_pe.unsqueeze(0).expand(heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1).transpose(0, 1)  # [H, qlen, dn + dr]
        if ctx == qlen:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            qpos = torch.arange(ctx - qlen, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[rows] = o.transpose(0, 1)
    return out


def _decode_absorbed(q_nope, q_pe, cache, meta, scale, w_uk, w_uv, kernels: bool = False) -> torch.Tensor:
    """Single-token sequences: scores and the weighted sum over the latent pages directly,
    W_UK absorbed into the query and W_UV applied after (see the module docstring)."""
    nd = q_nope.shape[0]
    heads, dv, rank = w_uv.shape
    q = torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1)  # [nd, H, r + dr]
    if kernels:
        o_lat = mla_triton.decode(q, cache, meta.block_tables[:nd], meta.ctx_len[:nd], scale, rank)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)
    o_lat = q.new_empty(nd, heads, rank)
    bs, width = cache.shape[1:]
    for rows, nblk in _decode_groups(meta, bs):
        tables = meta.block_tables[:nd, :nblk] if rows is None else meta.block_tables.index_select(0, rows)[:, :nblk]
        ctx = meta.ctx_len[:nd] if rows is None else meta.ctx_len.index_select(0, rows)
        n = tables.shape[0]
        pages = dequantize(cache.index_select(0, tables.reshape(-1).long()), 1.0, q.dtype)
        kv = pages.view(n, 1, nblk * bs, width)  # one "KV head" shared by every query head
        visible = torch.arange(nblk * bs, device=q.device)[None, :] < ctx[:, None]
        qd = q if rows is None else q.index_select(0, rows)
        o = F.scaled_dot_product_attention(qd.unsqueeze(2), kv, kv[..., :rank],
                                           attn_mask=visible[:, None, None, :], scale=scale,
                                           enable_gqa=heads > 1).squeeze(2)
        if rows is None:
            o_lat = o
        else:
            o_lat.index_copy_(0, rows, o)
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)
