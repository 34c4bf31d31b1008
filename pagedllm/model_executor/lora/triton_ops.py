"""Batched LoRA on CUDA: shrink (x @ A.T) and expand (y += h @ B.T) for every token's
adapter in one launch each, grouped by adapter (Punica's SGMV idea).

Tokens are listed grouped by the slot their adapter occupies (`sorted_tokens`, with
`counts[s]` tokens of slot s starting at `starts[s]`; base-model tokens are not listed).
The grid is fixed for a given number of tokens: (token tiles x output tiles, slots); a
program whose tile lies past its slot's token count returns at once. Nothing depends on
the batch's contents but the index buffers, so a decode step with LoRA is captured in a
CUDA graph like any other (the buffers are persistent, refreshed before each replay).

Also run under TRITON_INTERPRET=1 on the CPU, in float32, against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _slot_tile(tok_ptr, start_ptr, slot, count, pid_m, pid_n, N, BM: tl.constexpr, BN: tl.constexpr):
    """The tile of one adapter slot's tokens a program owns: the token rows (from the
    slot's run of the sorted token list), their mask, and the output columns with theirs."""
    first = tl.load(start_ptr + slot)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + first + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return rows, m_mask, offs_n, offs_n < N


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, tok_ptr, cnt_ptr, start_ptr, N, K, K_PER,
                   sxm, sxk, sal, san, sak, shm, shn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_TILES: tl.constexpr,
                   SPLIT_K: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    count = tl.load(cnt_ptr + slot)
    pid_k = pid % SPLIT_K
    pid = pid // SPLIT_K
    pid_m = pid // N_TILES
    if pid_m * BM >= count:
        return
    rows, m_mask, offs_n, n_mask = _slot_tile(tok_ptr, start_ptr, slot, count, pid_m, pid % N_TILES, N,
                                              BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * sal
    k_end = tl.minimum(K, (pid_k + 1) * K_PER)
    for k0 in range(pid_k * K_PER, k_end, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < k_end
        xt = tl.load(x_ptr + rows[:, None] * sxm + offs_k[None, :] * sxk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_n[None, :] * san + offs_k[:, None] * sak,
                     mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    h_ptrs = h_ptr + rows[:, None] * shm + offs_n[None, :] * shn
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])
    else:  # partial sums over K slices (h starts at zero)
        tl.atomic_add(h_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, tok_ptr, cnt_ptr, start_ptr, N, K,
                   shm, shk, sbl, sbn, sbk, sym, syn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_TILES: tl.constexpr,
                   IEEE: tl.constexpr):
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    count = tl.load(cnt_ptr + slot)
    pid_m = pid // N_TILES
    if pid_m * BM >= count:
        return
    rows, m_mask, offs_n, n_mask = _slot_tile(tok_ptr, start_ptr, slot, count, pid_m, pid % N_TILES, N,
                                              BM, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * sbl
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < K
        ht = tl.load(h_ptr + rows[:, None] * shm + offs_k[None, :] * shk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bt = tl.load(b_base + offs_n[None, :] * sbn + offs_k[:, None] * sbk,
                     mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(ht, bt, input_precision="ieee")
        else:
            acc += tl.dot(ht.to(bt.dtype), bt)
    y_ptrs = y_ptr + rows[:, None] * sym + offs_n[None, :] * syn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _pow2(n: int, lo: int = 16, hi: int = 128) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _block_m(m: int) -> int:
    return 16 if m <= 256 else 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor) -> torch.Tensor:
    """h[t] = x[t] @ a[slot(t)].T for every listed token t; x [M, K], a [L, R, K] ->
    h [M, R] float32 (rows of unlisted tokens are left unset)."""
    m, k = x.shape
    slots, r, _ = a.shape
    bm, bn, bk = _block_m(m), _pow2(r, hi=64), 64 if m > 256 else 128
    # Few tokens make few tiles (one per 16 tokens of a slot): the long K is split over
    # programs too, so that a decode step's shrink fills the GPU.
    split_k = max(1, min(16, k // (4 * bk))) if m <= 256 else 1
    k_per = triton.cdiv(triton.cdiv(k, split_k), bk) * bk
    h = (torch.zeros if split_k > 1 else torch.empty)((m, r), dtype=torch.float32, device=x.device)
    n_tiles = triton.cdiv(r, bn)
    grid = (triton.cdiv(m, bm) * n_tiles * split_k, slots)
    _shrink_kernel[grid](x, a, h, sorted_tokens, counts, starts, r, k, k_per,
                         x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
                         h.stride(0), h.stride(1), BM=bm, BN=bn, BK=bk, N_TILES=n_tiles,
                         SPLIT_K=split_k, IEEE=x.dtype == torch.float32)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, sorted_tokens: torch.Tensor,
                counts: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """y[t] += h[t] @ b[slot(t)].T for every listed token t, in place; h [M, R] float32,
    b [L, N, R], y [M, N]."""
    m, r = h.shape
    slots, n, _ = b.shape
    bm, bn, bk = _block_m(m), 128 if m > 256 else 64, _pow2(r, hi=64)
    n_tiles = triton.cdiv(n, bn)
    grid = (triton.cdiv(m, bm) * n_tiles, slots)
    _expand_kernel[grid](h, b, y, sorted_tokens, counts, starts, n, r,
                         h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
                         y.stride(0), y.stride(1), BM=bm, BN=bn, BK=bk, N_TILES=n_tiles,
                         IEEE=b.dtype == torch.float32)
    return y
