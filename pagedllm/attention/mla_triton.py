"""MLA decode over latent pages in Triton (CUDA; the CPU runs it in Triton's interpreter
for tests), and the latent write by slot mapping.

A program owns one decoding sequence and BLOCK_H of its query heads: every latent page
it loads (kv_lora_rank + rope values a token) serves all those heads at once, which is
MLA's point: per cached token one latent read whatever the number of heads. Scores are
q_lat . c + q_pe . k_pe (W_UK already absorbed into q_lat), the softmax is online over the
context (flash-attention style) and the output is the weighted sum of latents
[heads, kv_lora_rank]; W_UV is applied after, by the caller. Only the grid depends on the
host (sequences x head blocks): lengths and block tables are read on the device, so decode
steps can be captured in CUDA graphs; padding rows (slot -1) write nothing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers check `available()`
    triton = None


def available(cache: torch.Tensor) -> bool:
    return triton is not None and cache.is_cuda


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _write_latent_kernel(L, C, slots, stride_lt, stride_cs, WIDTH: tl.constexpr,
                             BLOCK: tl.constexpr, FP8: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:
            offs = tl.arange(0, BLOCK)
            mask = offs < WIDTH
            x = tl.load(L + t * stride_lt + offs, mask=mask)
            if FP8:  # e4m3, scale 1, saturated
                x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
            tl.store(C + slot * stride_cs + offs, x.to(C.dtype.element_ty), mask=mask)

    @triton.jit
    def _mla_decode_kernel(Q, C, Out, block_tables, ctx_lens, scale_log2, H,
                           stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
                           RANK: tl.constexpr, ROPE: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
                           BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                           IEEE: tl.constexpr):
        seq = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        rr = tl.arange(0, BR)
        rp = tl.arange(0, BP)
        q_row = Q + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
        q_c = tl.load(q_row + rr[None, :], mask=hmask[:, None] & (rr < RANK)[None, :], other=0.0)
        q_p = tl.load(q_row + RANK + rp[None, :], mask=hmask[:, None] & (rp < ROPE)[None, :], other=0.0)
        ctx = tl.load(ctx_lens + seq)
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        lsum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BR], dtype=tl.float32)
        for start in range(0, ctx, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nmask = n < ctx
            blk = tl.load(block_tables + seq * stride_bt + n // PAGE, mask=nmask, other=0).to(tl.int64)
            row = C + blk * stride_cb + (n % PAGE) * stride_cs
            c = tl.load(row[:, None] + rr[None, :], mask=nmask[:, None] & (rr < RANK)[None, :], other=0.0)
            k_pe = tl.load(row[:, None] + RANK + rp[None, :], mask=nmask[:, None] & (rp < ROPE)[None, :],
                           other=0.0)
            c = c.to(Q.dtype.element_ty)  # fp8 pages: read back in the compute dtype
            k_pe = k_pe.to(Q.dtype.element_ty)
            if IEEE:  # float32: full precision (tl.dot's float32 default is TF32)
                s = tl.dot(q_c, tl.trans(c), input_precision="ieee")
                s = tl.dot(q_p, tl.trans(k_pe), s, input_precision="ieee")
            else:
                s = tl.dot(q_c, tl.trans(c))
                s = tl.dot(q_p, tl.trans(k_pe), s)
            s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            if IEEE:
                acc = tl.dot(p, c, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None])
            m = m_new
        out = acc / lsum[:, None]
        o_ptr = Out + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + rr[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=hmask[:, None] & (rr < RANK)[None, :])


def write_latent(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, W] into cache [blocks, block_size, W]; rows with slot -1 write nothing."""
    width = cache.shape[-1]
    flat = cache.view(-1, width)
    _write_latent_kernel[(latent.shape[0],)](latent, flat, slot_mapping, latent.stride(0), flat.stride(0),
                                             WIDTH=width, BLOCK=triton.next_power_of_2(width),
                                             FP8=cache.dtype == torch.float8_e4m3fn)


def decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor,
           scale: float, rank: int) -> torch.Tensor:
    """q [S, H, rank + rope] (q_lat then q_pe) of S single-token sequences over
    cache [blocks, page, rank + rope] -> the softmax-weighted latent sum [S, H, rank]."""
    seqs, heads, width = q.shape
    out = q.new_empty(seqs, heads, rank)
    if seqs == 0:
        return out
    block_h = 16
    page = cache.shape[1]
    ieee = q.dtype == torch.float32
    block_n = 16 if ieee else 32
    _mla_decode_kernel[(seqs, triton.cdiv(heads, block_h))](
        q, cache, out, block_tables, ctx_lens, scale * 1.4426950408889634, heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), RANK=rank, ROPE=width - rank, BR=_pow2(rank), BP=_pow2(width - rank),
        BLOCK_H=block_h, PAGE=page, BLOCK_N=block_n, IEEE=ieee, num_warps=4 if ieee else 8)
    return out
