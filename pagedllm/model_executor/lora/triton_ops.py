"""Batched LoRA on CUDA: shrink (x @ A.T) and expand (y += h @ B.T) for every token's
adapter in one launch each, grouped by adapter (Punica's SGMV idea).

Tokens are listed grouped by the slot their adapter occupies (`sorted_tokens`, with
`counts[s]` tokens of slot s starting at `starts[s]`; base-model tokens are not listed),
and a tile table names the (slot, token tile) pairs those runs fill (`LoRABatch`). The
grid is fixed for a given number of tokens: (table entries x output tiles); a program
whose entry is unused returns at once. Nothing depends on
the batch's contents but the index buffers, so a decode step with LoRA is captured in a
CUDA graph like any other (the buffers are persistent, refreshed before each replay).

Also run under TRITON_INTERPRET=1 on the CPU, in float32, against the torch path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

# _dot: a @ b, float32 in full precision; num_sms: what launch sizes are chosen against
from pagedllm.attention.triton_backend import _dot
from pagedllm.attention.triton_backend import num_sms as _num_sms

if TYPE_CHECKING:  # layers.py imports this module when a step runs (no cycle)
    from pagedllm.model_executor.lora.layers import LoRABatch


@triton.jit
def _tile(pid, tile_slot_ptr, tile_m_ptr, tok_ptr, cnt_ptr, start_ptr, BM: tl.constexpr):
    """The tile a program owns, from the step's tile table (entry `pid`): its slot (-1: an
    unused entry, the program has nothing to do) and the token rows of that slot it covers
    (from the slot's run of the sorted token list) with their mask."""
    slot = tl.load(tile_slot_ptr + pid)
    # An unused entry (-1, -1) reads slot 0's first tile, in bounds; the caller returns.
    m_tile = tl.maximum(tl.load(tile_m_ptr + pid), 0)
    safe = tl.maximum(slot, 0)
    count = tl.load(cnt_ptr + safe)
    first = tl.load(start_ptr + safe)
    offs_m = m_tile * BM + tl.arange(0, BM)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + first + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, rows, m_mask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, tok_ptr, cnt_ptr, start_ptr, tile_slot_ptr, tile_m_ptr,
                   N, K, K_PER, sxm, sxk, sal, san, sak, shs, shm, shn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_TILES: tl.constexpr,
                   SPLIT_K: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K
    pid_mn = pid // SPLIT_K
    slot, rows, m_mask = _tile(pid_mn // N_TILES, tile_slot_ptr, tile_m_ptr, tok_ptr, cnt_ptr,
                               start_ptr, BM)
    if slot < 0:
        return
    offs_n = (pid_mn % N_TILES) * BN + tl.arange(0, BN)
    n_mask = offs_n < N
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
        acc += _dot(xt, at, IEEE)
    # Each K slice stores its partial sum in its own plane of h (the expand adds them up):
    # no zeroed buffer to launch a fill for, no atomics.
    h_ptrs = h_ptr + pid_k * shs + rows[:, None] * shm + offs_n[None, :] * shn
    tl.store(h_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _summed_h(h_rows, ks, hm, shk, shs, SPLITS: tl.constexpr):
    """The shrink's SPLITS K slices of h at columns `ks` of these token rows, summed in
    order (float32)."""
    ht = tl.load(h_rows + ks[None, :] * shk, mask=hm, other=0.0)
    for split in range(1, SPLITS):
        ht += tl.load(h_rows + split * shs + ks[None, :] * shk, mask=hm, other=0.0)
    return ht


@triton.jit
def _add_into(y_ptr, rows, offs_n, m_mask, n_mask, sym, syn, acc):
    """y[rows, offs_n] += acc (summed in float32, stored in y's dtype)."""
    y_ptrs = y_ptr + rows[:, None] * sym + offs_n[None, :] * syn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, tok_ptr, cnt_ptr, start_ptr, tile_slot_ptr, tile_m_ptr,
                   N, K, shs, shm, shk, sbl, sbn, sbk, sym, syn,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, N_COLS: tl.constexpr,
                   GROUP: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
    """Each program covers GROUP output tiles of BN columns side by side: where the rank
    fits one K step (K <= BK, the usual case) it reads and sums the shrink's slices of its
    token rows once for all of them, rather than once per output tile."""
    pid = tl.program_id(0)
    slot, rows, m_mask = _tile(pid // N_COLS, tile_slot_ptr, tile_m_ptr, tok_ptr, cnt_ptr,
                               start_ptr, BM)
    if slot < 0:
        return
    n_first = (pid % N_COLS) * (GROUP * BN)
    b_base = b_ptr + slot.to(tl.int64) * sbl
    h_rows = h_ptr + rows[:, None] * shm
    offs_k = tl.arange(0, BK)
    if K <= BK:  # the rank in one step: this tile's h once, for every output tile
        k_mask = offs_k < K
        ht = _summed_h(h_rows, offs_k, m_mask[:, None] & k_mask[None, :], shk, shs, SPLITS)
        for g in range(GROUP):
            offs_n = n_first + g * BN + tl.arange(0, BN)
            n_mask = offs_n < N
            bt = tl.load(b_base + offs_n[None, :] * sbn + offs_k[:, None] * sbk,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            _add_into(y_ptr, rows, offs_n, m_mask, n_mask, sym, syn, _dot(ht.to(bt.dtype), bt, IEEE))
    else:
        for g in range(GROUP):
            offs_n = n_first + g * BN + tl.arange(0, BN)
            n_mask = offs_n < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + offs_k
                k_mask = ks < K
                ht = _summed_h(h_rows, ks, m_mask[:, None] & k_mask[None, :], shk, shs, SPLITS)
                bt = tl.load(b_base + offs_n[None, :] * sbn + ks[:, None] * sbk,
                             mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc += _dot(ht.to(bt.dtype), bt, IEEE)
            _add_into(y_ptr, rows, offs_n, m_mask, n_mask, sym, syn, acc)


# Launch settings, module-level so that benchmarks/lora_kernel_bench.py can sweep them: the
# most K slices the shrink of a decode step (up to 256 rows) and of a larger step is split
# into (fewer where SHRINK_MIN_WAVES programs per SM are launched without them), the output
# columns per expand tile, and the most output tiles one expand program covers (fewer where
# the step would then launch under EXPAND_MIN_WAVES programs per SM).
# Measured on an H100 (Llama-2-7B layer, rank 16, one adapter): a step of 256 decodes and a
# prompt's 512-token chunk (768 rows, 16 table entries) added 47% to the base products with
# the shrink unsplit and 27% split 16 ways; an 8,192-token chunk (132 entries, 2 slices)
# 13.6% unsplit and 13.1% in 4.
SHRINK_MAX_SPLIT_K = 16
SHRINK_PREFILL_SPLIT_K = 16
SHRINK_MIN_WAVES = 2
EXPAND_BLOCK_N = 128
EXPAND_MAX_GROUP = 4
EXPAND_MIN_WAVES = 2


def _pow2(n: int, lo: int = 16, hi: int = 128) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def expand_group(token_tiles: int, n_tiles: int, device: torch.device) -> int:
    """Output tiles per expand program: the most (a power of two up to EXPAND_MAX_GROUP)
    that still launches EXPAND_MIN_WAVES programs per SM for `token_tiles` table entries."""
    group, floor = 1, EXPAND_MIN_WAVES * _num_sms(device)
    while (group * 2 <= min(EXPAND_MAX_GROUP, n_tiles)
           and token_tiles * triton.cdiv(n_tiles, group * 2) >= floor):
        group *= 2
    return group


def shrink_split_k(programs: int, m: int, k: int, bk: int, device: torch.device) -> int:
    """K slices per shrink program: few tokens make few tiles (one per BLOCK_M tokens of a
    slot; a decode step's 256 rows, or those and a 512-token prompt chunk, fill 16 to 20),
    so the long K is split over programs too, until SHRINK_MIN_WAVES programs per SM run,
    each slice at least 4 K steps."""
    cap = SHRINK_MAX_SPLIT_K if m <= 256 else SHRINK_PREFILL_SPLIT_K
    want = triton.cdiv(SHRINK_MIN_WAVES * _num_sms(device), max(programs, 1))
    return max(1, min(cap, want, k // (4 * bk)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """h[:, t].sum(0) = x[t] @ a[slot(t)].T for every listed token t of `batch` (bound to
    x's rows); x [M, K], a [L, R, K] -> h [S, M, R] float32: the partial sums of S slices
    of K (rows of unlisted tokens are left unset). `lora_expand` adds the slices up."""
    m, k = x.shape
    _, r, _ = a.shape
    bm, bn, bk = batch.block_m, _pow2(r, hi=64), 64 if m > 256 else 128
    tiles, n_tiles = batch.tile_slot.numel(), triton.cdiv(r, bn)
    split_k = shrink_split_k(tiles * n_tiles, m, k, bk, x.device)
    k_per = triton.cdiv(triton.cdiv(k, split_k), bk) * bk
    h = torch.empty((split_k, m, r), dtype=torch.float32, device=x.device)
    grid = (tiles * n_tiles * split_k,)
    _shrink_kernel[grid](x, a, h, batch.sorted_tokens, batch.counts, batch.starts, batch.tile_slot,
                         batch.tile_m, r, k, k_per, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
                         a.stride(2), h.stride(0), h.stride(1), h.stride(2), BM=bm, BN=bn, BK=bk,
                         N_TILES=n_tiles, SPLIT_K=split_k, IEEE=x.dtype == torch.float32)
    return h


def lora_expand(h: torch.Tensor, b: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """y[t] += h[:, t].sum(0) @ b[slot(t)].T for every listed token t of `batch`, in place;
    h [S, M, R] float32 (`lora_shrink`'s slices), b [L, N, R], y [M, N]."""
    splits, _, r = h.shape
    _, n, _ = b.shape
    bm, bn, bk = batch.block_m, EXPAND_BLOCK_N, _pow2(r, hi=64)
    tiles = batch.tile_slot.numel()
    n_tiles = triton.cdiv(n, bn)
    group = expand_group(tiles, n_tiles, y.device)
    n_cols = triton.cdiv(n_tiles, group)
    _expand_kernel[(tiles * n_cols,)](
        h, b, y, batch.sorted_tokens, batch.counts, batch.starts, batch.tile_slot, batch.tile_m,
        n, r, h.stride(0), h.stride(1), h.stride(2), b.stride(0), b.stride(1), b.stride(2),
        y.stride(0), y.stride(1), BM=bm, BN=bn, BK=bk, N_COLS=n_cols, GROUP=group, SPLITS=splits,
        IEEE=b.dtype == torch.float32)
    return y
