"""Paged attention in Triton for CUDA: KV write by slot mapping, and one attention kernel
that serves decodes and (chunked) prefills straight from the paged cache.

The attention kernel is GQA-aware: a program owns one KV head and a tile of query tokens,
and stacks the query heads that share that KV head into the rows of its matrix, so every
K/V page is loaded once per group instead of once per query head. Keys are read page by
page through the block table with an online softmax (flash-attention style), causally
masked by absolute position, so a prefill chunk sees its cached prefix and itself.
Decodes use one query per tile (grid: sequences x KV heads); prefills use tiles of
`BLOCK_M // group` queries. Nothing in a launch depends on host-side values other than
the grid, which is what lets decode steps be captured in CUDA graphs.

ALiBi models (Baichuan-13B) pass per-head slopes; the kernel adds -m_h * (i - j) to each
score (ALIBI is a compile-time switch, so other models pay nothing). Sliding-window layers
(Mistral) mask keys more than `window - 1` positions back and skip the pages before them.
Gemma 2 soft-caps the scaled scores, cap * tanh(score / cap) (SOFTCAP, also compile-time).
Attention sinks (gpt-oss; SINKS, a compile-time switch too) start each row's online softmax
at its head's sink logit with a weight of one and no value: the sink joins the denominator.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm import pdl
from pagedllm.attention.metadata import AttentionMetadata, long_decode
from pagedllm.config import env_flag
from pagedllm.pdl import launch_dependents, wait


@triton.jit
def _write_kv_kernel(K, V, KC, VC, slots, stride_kt, stride_vt, stride_cb, stride_cs, stride_ch,
                     inv_k_scale, inv_v_scale, ROW: tl.constexpr, BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """One token's K and V rows (every KV head) into its slot's page, through the pages'
    strides: token-major pages (a slot's heads contiguous) or head-major ones."""
    if PDL:  # placed early (pagedllm.pdl): wait for the kernel before, let the next be placed
        tok = wait()
        K += tok
        V += tok
        slots += tok
        launch_dependents()
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(K + t * stride_kt + offs, mask=mask)
        v = tl.load(V + t * stride_vt + offs, mask=mask)
        if FP8:  # e4m3 pages hold x / scale, saturated (e4m3fn has no infinity)
            k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0).to(KC.dtype.element_ty)
            v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0).to(VC.dtype.element_ty)
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + (offs // HEAD_DIM) * stride_ch \
            + offs % HEAD_DIM
        tl.store(KC + dst, k, mask=mask)
        tl.store(VC + dst, v, mask=mask)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b; with float32 caches in full precision (tl.dot's default for float32 is TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_block(q, acc, m_i, l_i, start, KC, VC, table, kv_end, qpos, row_ok, slope, d, d_ok,
                  scale_log2, softcap_log2, window, kvh, stride_cb, stride_cs, stride_ch,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, WINDOW: tl.constexpr,
                  CAUSAL: tl.constexpr, MASK: tl.constexpr):
    """One block of BLOCK_N keys into the tile's online softmax. MASK off: every key of the
    block exists and every row sees it (no bounds on the loads, no score select)."""
    n = start + tl.arange(0, BLOCK_N)
    if MASK:
        n_ok = n < kv_end
        page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
    else:
        page = tl.load(table + n // PAGE).to(tl.int64)
    base = page * stride_cb + (n % PAGE) * stride_cs + kvh * stride_ch
    if MASK:
        k = tl.load(KC + base[None, :] + d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    else:
        k = tl.load(KC + base[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
    if FP8:  # e4m3 pages, exact in the compute dtype (q's); k_scale is in scale_log2
        k = k.to(q.dtype)
    s = _dot(q, k, IEEE) * scale_log2
    if SOFTCAP:  # c * tanh(s / c) on the log2-scaled scores, c = cap * log2(e): the same
        # as capping the natural ones; tanh(x) = 1 - 2 / (exp(2x) + 1), saturating to +-1
        s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap_log2) + 1.0))
    if ALIBI:
        s += slope[:, None] * (n[None, :] - qpos[:, None]).to(tl.float32)
    if MASK:
        if CAUSAL:
            visible = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
        else:
            visible = (n[None, :] < kv_end) & row_ok[:, None]
        if WINDOW:
            visible &= n[None, :] > qpos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK:
        v = tl.load(VC + base[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        v = tl.load(VC + base[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    if FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _tile_keys(ctx, qlen, q0, TILE_Q: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys a tile of queries [q0, q0 + TILE_Q) of a sequence attends to: up to the last one
    any of its rows sees (causal), or all `ctx` (bidirectional: a whole input in one step).
    What the attention kernel splits and the combine counts; they must agree."""
    keys = ctx
    if CAUSAL:
        keys = ctx - qlen + tl.minimum(q0 + TILE_Q, qlen)
    return keys


# A short context (up to SHORT_SPLITS * SPLIT_MIN_KEYS / 2 keys) takes up to SHORT_SPLITS
# splits of half the minimum: on an H200 at batch 1 (Qwen3-30B-A3B shape) 384 keys took
# 10.1 us a layer in two splits of 256 and 8.1 in three of 128, while 2,048 keys were
# fastest in eight of 256 (12.8 us, against 13.3 in sixteen of 128)
# (benchmarks/results/2026-12-06-gpu-h200-attn-small-batch-*.json).
SHORT_SPLITS = 4
_SHORT_SPLITS: tl.constexpr = tl.constexpr(SHORT_SPLITS)


@triton.jit
def _split_keys(keys, KV_SPLITS, BLOCK_N: tl.constexpr, SPLIT_MIN_KEYS: tl.constexpr):
    """Keys each split of a tile's `keys` reads (a decode's are its context): whole key
    blocks, over split_count(keys) splits. The attention kernel and the combine must agree
    on it; the count never falls as keys grow, so a launch sized for its longest tile
    (_splits_keys_fill) covers every shorter one."""
    n = tl.maximum(tl.cdiv(keys, SPLIT_MIN_KEYS), tl.minimum(_SHORT_SPLITS, tl.cdiv(keys, SPLIT_MIN_KEYS // 2)))
    n = tl.maximum(tl.minimum(n, KV_SPLITS), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(keys, n), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _paged_attention_kernel(
    Q, KC, VC, Out, block_tables, q_starts, q_lens, ctx_lens, tile_seq, tile_q, Slopes, Sinks,
    Part, PartML, scale_log2, v_scale, window, softcap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt, KV_SPLITS,
    GROUP: tl.constexpr, TILE_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, ALIBI: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
    CAUSAL: tl.constexpr = True, SPLIT: tl.constexpr = True, FP8_F16: tl.constexpr = False,
    KEY_SPLITS: tl.constexpr = False, SPLIT_MIN_KEYS: tl.constexpr = 256,
    HEADS_FIRST: tl.constexpr = False,
):
    if PDL:  # placed early (pagedllm.pdl): wait for the kernel before, let the next be placed
        tok = wait()
        Q += tok
        KC += tok
        VC += tok
        block_tables += tok
        q_starts += tok
        q_lens += tok
        ctx_lens += tok
        tile_seq += tok
        tile_q += tok
        Part += tok
        PartML += tok
        launch_dependents()
    if HEADS_FIRST:  # decode launch on a (KV heads, sequences) grid: the programs that read
        # one sequence's pages (a page holds every KV head's rows) are placed side by side
        kvh = tl.program_id(0)
        pid = tl.program_id(1)
        num_kvh = tl.num_programs(0)
    else:
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kvh = tl.num_programs(1)
    if DIRECT:  # decode launch: tile i is sequence i, query 0
        tile = pid
        seq = pid
        q0 = 0
    else:  # tiles in reverse: a prompt's last tiles see the most keys, so they start first
        # and the cheap early tiles fill the end of the launch instead of a long tail
        tile = tl.num_programs(0) - 1 - pid
        seq = tl.load(tile_seq + tile)
        q0 = tl.load(tile_q + tile)
    ctx = tl.load(ctx_lens + seq)
    qlen = tl.load(q_lens + seq)
    kv_end = _tile_keys(ctx, qlen, q0, TILE_Q, CAUSAL)
    keys = kv_end  # the tile's (kv_end is narrowed to a split's below)
    split = 0
    chunk = kv_end
    if KEY_SPLITS:  # split keys (flash-decoding; for prefill tiles too): this program's
        # key range is [split * chunk, (split + 1) * chunk) of the tile's keys, whole key
        # blocks and at least SPLIT_MIN_KEYS each, so a short context leaves the later
        # splits idle (they return at once)
        split = tl.program_id(2)
        chunk = _split_keys(kv_end, KV_SPLITS, BLOCK_N, SPLIT_MIN_KEYS)
        if split * chunk >= tl.maximum(kv_end, 1):
            return
    qstart = tl.load(q_starts + seq)

    m = tl.arange(0, BLOCK_M)
    qi = q0 + m // GROUP
    head = kvh * GROUP + m % GROUP
    row_ok = (m < TILE_Q * GROUP) & (qi < qlen)
    qpos = ctx - qlen + qi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (qstart + qi).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8_F16:  # fp8 pages: products in fp16, see TritonPagedAttention.FP8_COMPUTE
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    slope = 0.0  # per-row ALiBi slope, in the log2 domain the scores live in
    if ALIBI:
        slope = tl.load(Slopes + head, mask=row_ok, other=0.0) * 1.4426950408889634
    if SINKS:  # the sink's score (log2 domain), weight exp2(0) = 1, value zero (one split's)
        m_i = tl.load(Sinks + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        if KEY_SPLITS:
            m_i = tl.where(split == 0, m_i, -1.0e30)
            l_i = tl.where(split == 0, l_i, 0.0)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables + seq.to(tl.int64) * stride_bt
    kv_start = 0
    if WINDOW:  # keys before the first one any row of the tile sees are skipped
        kv_start = tl.maximum(ctx - qlen + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
    # Key blocks every row of the tile sees whole (before the causal diagonal, inside the
    # keys) need no mask: they run first, without the per-score compare and select; the
    # blocks on the diagonal, past the keys or reaching into the window run masked.
    full_end = kv_start
    if SPLIT and not WINDOW:
        if CAUSAL:
            full_end = tl.maximum((ctx - qlen + q0 + 1) // BLOCK_N * BLOCK_N, kv_start)
        else:
            full_end = kv_end // BLOCK_N * BLOCK_N
    if KEY_SPLITS:  # keys [lo, hi) of the tile's (a decode's kv_end is its ctx)
        lo = split * chunk
        kv_end = tl.minimum(lo + chunk, kv_end)
        kv_start = tl.maximum(kv_start, lo)
        full_end = tl.minimum(tl.maximum(full_end, kv_start), kv_end)
    for start in range(kv_start, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, start, KC, VC, table, kv_end, qpos, row_ok, slope, d, d_ok,
            scale_log2, softcap_log2, window, kvh, stride_cb, stride_cs, stride_ch,
            PAGE, BLOCK_N, IEEE, FP8, SOFTCAP, ALIBI, WINDOW, CAUSAL, False)
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, start, KC, VC, table, kv_end, qpos, row_ok, slope, d, d_ok,
            scale_log2, softcap_log2, window, kvh, stride_cb, stride_cs, stride_ch,
            PAGE, BLOCK_N, IEEE, FP8, SOFTCAP, ALIBI, WINDOW, CAUSAL, True)
    if KEY_SPLITS:
        if chunk < keys:  # the split's unnormalised sums, for _combine_splits_kernel
            part = (tile * num_kvh + kvh) * KV_SPLITS + split
            tl.store(Part + part * BLOCK_M * BLOCK_D + m[:, None] * BLOCK_D + d[None, :], acc)
            tl.store(PartML + part * 2 * BLOCK_M + m, m_i)
            tl.store(PartML + part * 2 * BLOCK_M + BLOCK_M + m, l_i)
            return
        # else split 0 saw every key: its output is final (the combine skips this tile)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    if FP8:  # the values were v / v_scale
        out = out * v_scale
    tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(Part, PartML, Out, q_starts, q_lens, ctx_lens, tile_seq, tile_q, v_scale,
                           stride_ot, stride_oh, GROUP: tl.constexpr, TILE_Q: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                           KV_SPLITS, FP8: tl.constexpr, PDL: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLIT_MIN_KEYS: tl.constexpr, DIRECT: tl.constexpr,
                           CAUSAL: tl.constexpr = True):
    """A tile's output (a decode's, or a prefill tile's) from the partial softmaxes of the
    splits that had keys: each split's sums rescaled to the largest running maximum, added,
    normalised once. A tile whose keys all fell in split 0 was written by it."""
    if PDL:
        tok = wait()
        Part += tok
        PartML += tok
        q_starts += tok
        q_lens += tok
        ctx_lens += tok
        tile_seq += tok
        tile_q += tok
        launch_dependents()
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    if DIRECT:
        seq = tile
        q0 = 0
    else:
        seq = tl.load(tile_seq + tile)
        q0 = tl.load(tile_q + tile)
    ctx = tl.load(ctx_lens + seq)
    qlen = tl.load(q_lens + seq)
    kv_end = _tile_keys(ctx, qlen, q0, TILE_Q, CAUSAL)
    chunk = _split_keys(kv_end, KV_SPLITS, BLOCK_N, SPLIT_MIN_KEYS)
    if chunk >= kv_end:
        return
    used = tl.cdiv(kv_end, chunk)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    first = (tile * tl.num_programs(1) + kvh) * KV_SPLITS
    m_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for s in range(used):
        m_max = tl.maximum(m_max, tl.load(PartML + (first + s) * 2 * BLOCK_M + m))
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for s in range(used):
        w = tl.exp2(tl.load(PartML + (first + s) * 2 * BLOCK_M + m) - m_max)
        l_sum += w * tl.load(PartML + (first + s) * 2 * BLOCK_M + BLOCK_M + m)
        acc += w[:, None] * tl.load(Part + (first + s) * BLOCK_M * BLOCK_D + m[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    if FP8:
        out = out * v_scale
    qi = q0 + m // GROUP
    rows = (tl.load(q_starts + seq) + qi).to(tl.int64)
    head = kvh * GROUP + m % GROUP
    ok = ((m < TILE_Q * GROUP) & (qi < qlen))[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _decode_rows_kernel(Q, KC, VC, Out, block_tables, q_starts, ctx_lens, scale_log2, v_scale, window,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                        stride_bt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_N: tl.constexpr, FP8: tl.constexpr, WINDOW: tl.constexpr,
                        PDL: tl.constexpr):
    """Decode attention for one query row a (sequence, head) program, on the CUDA cores: with
    one query per KV head (GROUP 1: Llama-2, MHA models) the tensor-core tile of the general
    kernel holds 1 real row in 16 and its operands go through shared memory; here q . k and
    p . v are float32 multiply-and-sums over the head's values as they are loaded."""
    if PDL:
        tok = wait()
        Q += tok
        KC += tok
        VC += tok
        block_tables += tok
        q_starts += tok
        ctx_lens += tok
        launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ctx_lens + seq)
    row = tl.load(q_starts + seq).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    q = q * scale_log2  # scores in the log2 domain (k_scale included for fp8 pages)
    table = block_tables + seq.to(tl.int64) * stride_bt
    kv_start = 0
    if WINDOW:
        kv_start = tl.maximum(ctx - window, 0) // BLOCK_N * BLOCK_N
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(kv_start, ctx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < ctx
        if WINDOW:
            n_ok &= n > ctx - 1 - window
        page = tl.load(table + n // PAGE, mask=n < ctx, other=0).to(tl.int64)
        base = page * stride_cb + (n % PAGE) * stride_cs + head * stride_ch
        mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(KC + base[:, None] + d[None, :], mask=mask, other=0.0)
        if FP8:
            k = k.to(tl.float16)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        s = tl.where(n_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        v = tl.load(VC + base[:, None] + d[None, :], mask=mask, other=0.0)
        if FP8:
            v = v.to(tl.float16)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)
    if FP8:
        out = out * v_scale
    tl.store(Out + row * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def _prefill_setting(default_m: int, default: dict) -> tuple[int, dict]:
    """The prefill tile (queries x heads per tile, keys per block, warps, stages): the
    tuned default, or PAGEDLLM_PREFILL_LAUNCH="BLOCK_M,BLOCK_N,warps,stages" to try another
    on a card (benchmarks/prefill_attn_bench.py prints the candidates)."""
    raw = os.environ.get("PAGEDLLM_PREFILL_LAUNCH")
    if not raw:
        return default_m, default
    try:
        bm, bn, warps, stages = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"PAGEDLLM_PREFILL_LAUNCH={raw!r}: expected BLOCK_M,BLOCK_N,warps,stages") from None
    return bm, {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# Flash-decoding: a decode launch with fewer than KV_SPLIT_WAVES (sequence, KV head)
# programs per SM splits each sequence's keys over up to MAX_KV_SPLITS programs (whole key
# blocks each) until that many run, and a second kernel adds the splits' partial
# softmaxes. Without it a few long sequences (16 x 32k prompts decoding four at a time:
# 32 programs on 132 SMs) read their keys on a quarter of the GPU. The count depends only
# on the batch and the device, so a captured decode graph keeps it for any context length.
# Measured on an H100 (benchmarks/results/2026-12-06-gpu-h100-attn-decode-32k-splits-025eb05.json,
# one layer of Llama-3.1-8B's shape over 32k keys): 2 sequences 828 -> 114 us, 14 sequences
# (3 splits) 883 -> 624 us, 2,939 GB/s. PAGEDLLM_DECODE_KV_SPLITS=1 turns it off.
def _env_splits() -> int:
    raw = os.environ.get("PAGEDLLM_DECODE_KV_SPLITS", "16")
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 64:
        raise ValueError(f"PAGEDLLM_DECODE_KV_SPLITS={raw!r}: expected an integer from 1 (off) to 64")
    return int(raw)


MAX_KV_SPLITS = _env_splits()
KV_SPLIT_WAVES = 2
# Keys a split reads at least: a context shorter than MAX_KV_SPLITS of these uses fewer
# splits (the rest return at once), and one within the first is written by split 0 with no
# combine, so short decodes cost the split launch almost nothing. PAGEDLLM_SPLIT_MIN_KEYS
# sets another (a multiple of 64, the decode key block; benchmarks A/B it).
def _env_min_keys() -> int:
    raw = os.environ.get("PAGEDLLM_SPLIT_MIN_KEYS", "256")
    if not raw.strip().isdigit() or int(raw) < 64 or int(raw) % 64:
        raise ValueError(f"PAGEDLLM_SPLIT_MIN_KEYS={raw!r}: expected a multiple of 64")
    return int(raw)


SPLIT_MIN_KEYS = _env_min_keys()
_SMS: dict[torch.device, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (what launch sizes are chosen against,
    here and in the LoRA kernels). Elsewhere (Triton's interpreter on the CPU) a small
    GPU's 8, so that the interpreted tests split and group work as a GPU run would."""
    if device.type != "cuda":
        return 8
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def split_count(keys: int, splits: int) -> int:
    """How many of `splits` the kernels' _split_keys gives `keys` keys: one per
    SPLIT_MIN_KEYS, or up to SHORT_SPLITS of half that for a short context."""
    n = max(-(-keys // SPLIT_MIN_KEYS), min(SHORT_SPLITS, -(-keys // (SPLIT_MIN_KEYS // 2))))
    return max(1, min(n, splits))


def _splits_keys_fill(splits: int, host_ctx_lens) -> int:
    """An eager launch's split count: what its longest context uses (a captured launch
    cannot know, and keeps `splits`)."""
    return split_count(int(host_ctx_lens.max(initial=1)), splits)


def kv_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """Key splits per (sequence, KV head) of a decode launch (1: no split)."""
    want = triton.cdiv(KV_SPLIT_WAVES * num_sms(device), max(num_seqs * kv_heads, 1))
    return max(1, min(MAX_KV_SPLITS, want))


class TritonPagedAttention:
    name = "triton"
    splits_long_decodes = True  # honours AttentionMetadata.decode_long (DecodeGraphs' second set)
    supports_alibi = True
    supports_softcap = True
    supports_sinks = True
    supports_bidirectional = True
    graph_safe = True  # nothing in a launch reads the host: decode steps can be captured
    # Launch settings (keys per iteration, warps, pipeline stages), tuned on an H200.
    DECODE_LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    # What a kernel over fp8 pages multiplies in when the model runs in bf16/fp16: "fp16"
    # (queries, keys, values and probabilities in fp16, fp32 sums) or the model's dtype.
    # On SM89+ e4m3 -> fp16 is one instruction a pair of values, e4m3 -> bf16 goes through
    # fp16 and takes three, and the conversion is per key read (decode is bandwidth-bound:
    # the pages' bytes halve only if converting them costs less than the bytes saved).
    # Queries are clamped to fp16's range (+-65504) first; every e4m3 value is exact in fp16.
    FP8_COMPUTE = "fp16"
    # Over fp8 pages a key block of 128 is fastest (H100, benchmarks/attn_decode_bench.py:
    # 450 us against 461 at 64, for 256 x 512 keys on the Llama-2-7B shape; bf16 pages: 720).
    DECODE_LAUNCH_FP8 = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    # With grouped queries (several query heads a KV head: a program's tile holds the
    # group) and enough sequences that keys are not split, 64-key blocks on two warps are
    # fastest over fp8 pages (H100, Llama-3.1-8B shape, 512 sequences: 412 us against 456
    # at 128/4/2 for 1,024 keys, 785 against 866 for 2,048). Split launches keep 128/4/2:
    # at 32 sequences of 4,096 keys, 64/2/2 took 200 us against 125
    # (benchmarks/results/2026-12-07-gpu-h100-attn-decode-*.json).
    DECODE_LAUNCH_FP8_GQA = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2}
    # Decodes with one query per KV head (GROUP 1) and no ALiBi / soft-cap / sinks: "dot"
    # runs them in the general tensor-core kernel, "rows" in _decode_rows_kernel (float32
    # sums on the CUDA cores). "dot" until benchmarks/attn_decode_bench.py shows otherwise.
    DECODE_ROWS = "dot"
    DECODE_ROWS_LAUNCH = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    # Decode launches on a (KV heads, sequences) grid instead of (sequences, KV heads): the
    # programs reading one page's rows run together (PAGEDLLM_DECODE_HEADS_FIRST=1; A/B in
    # benchmarks/attn_decode_bench.py --heads-first 0 1).
    DECODE_HEADS_FIRST = env_flag("PAGEDLLM_DECODE_HEADS_FIRST")
    # The page pool head-major ([blocks, kv_heads, block_size, head_dim] a layer part: a
    # decode program's rows of a page contiguous) instead of token-major; the kernels read
    # and write either through strides (PAGEDLLM_KV_LAYOUT=hnd|nhd; PageSpec.pool_shape).
    HEAD_MAJOR_PAGES = os.environ.get("PAGEDLLM_KV_LAYOUT", "nhd").lower() == "hnd"
    BLOCK_M_PREFILL, PREFILL_LAUNCH = _prefill_setting(64, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2})

    @classmethod
    def tile_q(cls, group: int) -> int:
        """Queries per prefill tile for a GQA group size (the runner cuts tiles with it)."""
        return max(1, cls.BLOCK_M_PREFILL // group)

    @classmethod
    def _rows_decode(cls, group: int, q, alibi_slopes, logits_soft_cap, sinks, causal: bool) -> bool:
        """Whether this launch's decodes go to _decode_rows_kernel (DECODE_ROWS "rows")."""
        return (cls.DECODE_ROWS == "rows" and group == 1
                and alibi_slopes is None and logits_soft_cap is None and sinks is None and causal)

    @staticmethod
    def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        t, h, d = k.shape
        row = h * d
        _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                               *k_cache.stride()[:3], 1.0 / k_scale, 1.0 / v_scale, ROW=row,
                               BLOCK=_pow2(row), HEAD_DIM=d, PAGE=k_cache.shape[1],
                               FP8=k_cache.dtype == torch.float8_e4m3fn, **pdl.kernel_options(k))

    @staticmethod
    def _launch_args(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float,
                     alibi_slopes: torch.Tensor | None, sliding_window: int | None,
                     k_scale: float, v_scale: float,
                     logits_soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None, causal: bool = True) -> tuple[tuple, dict]:
        """The kernel's arguments shared by the decode and the prefill launches."""
        hq, dim = q.shape[1], q.shape[2]
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        common = dict(
            scale_log2=scale * 1.4426950408889634 * (k_scale if fp8 else 1.0), v_scale=v_scale,
            FP8=fp8, window=sliding_window or 0,
            softcap_log2=(logits_soft_cap or 0.0) * 1.4426950408889634, SOFTCAP=logits_soft_cap is not None,
            WINDOW=sliding_window is not None,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
            stride_cb=k_cache.stride(0), stride_cs=k_cache.stride(1), stride_ch=k_cache.stride(2),
            stride_bt=meta.block_tables.stride(0), KV_SPLITS=1,  # _split_launch sets its count
            GROUP=hq // k_cache.shape[2], HEAD_DIM=dim, BLOCK_D=_pow2(dim), PAGE=k_cache.shape[1],
            ALIBI=alibi_slopes is not None, IEEE=q.dtype == torch.float32,
            Sinks=q if sinks is None else sinks, SINKS=sinks is not None,  # any pointer when unused
            Part=q, PartML=q,  # flash-decoding's partial sums (set where a decode launch splits)
            CAUSAL=causal,
            FP8_F16=fp8 and q.dtype != torch.float32 and TritonPagedAttention.FP8_COMPUTE == "fp16",
            **pdl.kernel_options(q),
        )
        args = (q, k_cache, v_cache, out, meta.block_tables, meta.q_start, meta.q_len, meta.ctx_len)
        return args, common

    @classmethod
    def forward(cls, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None, causal: bool = True):
        cls.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        hkv = k.shape[1]
        group = q.shape[1] // hkv
        args, common = cls._launch_args(q, k_cache, v_cache, out, meta, scale, alibi_slopes,
                                        sliding_window, k_scale, v_scale, logits_soft_cap, sinks,
                                        causal)
        slopes = q if alibi_slopes is None else alibi_slopes  # any pointer when unused
        long = (meta.decode_long if meta.host_ctx_len is None
                else bool(meta.num_decode) and long_decode(meta.host_ctx_len[: meta.num_decode]))
        long = long and sliding_window is None
        if (meta.num_decode and not long
                and cls._rows_decode(group, q, alibi_slopes, logits_soft_cap, sinks, causal)):
            _decode_rows_kernel[(meta.num_decode, hkv)](
                q, k_cache, v_cache, out, meta.block_tables, meta.q_start, meta.ctx_len,
                common["scale_log2"], common["v_scale"], common["window"], *q.stride()[:2],
                *out.stride()[:2], *k_cache.stride()[:3], meta.block_tables.stride(0),
                HEAD_DIM=q.shape[2], BLOCK_D=common["BLOCK_D"], PAGE=common["PAGE"], FP8=common["FP8"],
                WINDOW=common["WINDOW"], PDL=common["PDL"],
                **({"launch_pdl": True} if common["PDL"] else {}), **cls.DECODE_ROWS_LAUNCH)
        elif meta.num_decode:
            block_m = max(16, _pow2(group))
            splits = 1 if sliding_window is not None else kv_splits(meta.num_decode, hkv, q.device)
            if long:  # the rows kernel (one query per KV head) has no splits: this one has
                splits = MAX_KV_SPLITS
                if meta.host_ctx_len is not None:
                    splits = _splits_keys_fill(splits, meta.host_ctx_len[: meta.num_decode])
            launch = cls.DECODE_LAUNCH
            if k_cache.dtype == torch.float8_e4m3fn:
                launch = cls.DECODE_LAUNCH_FP8_GQA if group > 1 and splits == 1 else cls.DECODE_LAUNCH_FP8
            cls._split_launch(args, (meta.q_start, meta.q_start), slopes, out, meta, common, launch,
                              meta.num_decode, hkv, splits, 1, block_m, True, cls.DECODE_HEADS_FIRST)
        if meta.num_prefill_tiles:
            cls._prefill(q, k, v, k_cache, v_cache, out, meta, scale, args, common, slopes,
                         plain=(alibi_slopes is None and sliding_window is None and logits_soft_cap is None
                                and sinks is None and causal))
        return out

    @classmethod
    def _prefill(cls, q, k, v, k_cache, v_cache, out, meta: AttentionMetadata, scale: float, args: tuple,
                 common: dict, slopes, plain: bool) -> None:
        """The step's prefill rows (after its decodes) into `out`, from the pages (this
        step's k and v are already written there; a subclass may read them directly).
        `plain`: causal, with no ALiBi, window, soft-cap or sinks (what a subclass's other
        kernel may need)."""
        tq, hkv = meta.prefill_tile_q, k_cache.shape[2]
        splits = 1
        if not common["WINDOW"]:  # few tiles (a small chunk after a long prefix): split keys
            splits = kv_splits(meta.prefill_busy_tiles or meta.num_prefill_tiles, hkv, q.device)
            if splits > 1 and meta.host_ctx_len is not None:
                splits = _splits_keys_fill(splits, meta.host_ctx_len[meta.num_decode :])
        cls._split_launch(args, (meta.prefill_tiles[0], meta.prefill_tiles[1]), slopes, out, meta, common,
                          cls.PREFILL_LAUNCH, meta.num_prefill_tiles, hkv, splits, tq,
                          max(16, _pow2(tq * (q.shape[1] // hkv))), False)

    @staticmethod
    def _split_launch(args: tuple, tiles: tuple, slopes, out, meta: AttentionMetadata, common: dict,
                      launch: dict, units: int, hkv: int, splits: int, tile_q: int, block_m: int,
                      direct: bool, heads_first: bool = False) -> None:
        """The attention kernel over `units` tiles (decodes when `direct`) x KV heads, each
        tile's keys split over `splits` programs; with more than one, the partial sums go to
        scratch buffers and _combine_splits_kernel writes the tiles' outputs."""
        # The count is a runtime argument (KEY_SPLITS the compile-time switch): as a
        # constexpr every new count compiled the kernel and the combine again, and paced
        # prompt chunks of varying sizes give varying counts mid-serving.
        common = dict(common, KV_SPLITS=splits)
        if splits > 1:
            n = units * hkv * splits
            common = dict(common,
                          Part=torch.empty(n * block_m * common["BLOCK_D"], dtype=torch.float32, device=out.device),
                          PartML=torch.empty(n * 2 * block_m, dtype=torch.float32, device=out.device))
        heads_first = heads_first and direct
        grid = (hkv, units, splits) if heads_first else (units, hkv, splits)
        _paged_attention_kernel[grid](
            *args, *tiles, slopes, TILE_Q=tile_q, BLOCK_M=block_m, DIRECT=direct, KEY_SPLITS=splits > 1,
            SPLIT_MIN_KEYS=SPLIT_MIN_KEYS, HEADS_FIRST=heads_first, **common, **launch)
        if splits > 1:
            _combine_splits_kernel[(units, hkv)](
                common["Part"], common["PartML"], out, meta.q_start, meta.q_len, meta.ctx_len, *tiles,
                common["v_scale"], out.stride(0), out.stride(1), GROUP=common["GROUP"], TILE_Q=tile_q,
                HEAD_DIM=common["HEAD_DIM"], BLOCK_M=block_m, BLOCK_D=common["BLOCK_D"], KV_SPLITS=splits,
                FP8=common["FP8"], PDL=common["PDL"], BLOCK_N=launch["BLOCK_N"], SPLIT_MIN_KEYS=SPLIT_MIN_KEYS,
                DIRECT=direct, CAUSAL=common["CAUSAL"], **({"launch_pdl": True} if common["PDL"] else {}),
                num_warps=4)


class TritonInvariantAttention(TritonPagedAttention):
    """The same kernel for the batch-invariant mode: decodes and prefill tiles launch it
    with one tile shape (BLOCK_M rows, the same key block, warps and stages), so a query's
    row is computed by the same instructions whether it is a decode or a prefill row, in
    whatever tile. Keys are walked from position 0 in BLOCK_N steps either way, and a key
    block a row cannot see changes nothing in it bit for bit (its weights are exp2(-inf)),
    so neither the tile's other rows nor where its walk ends make a difference. A decode
    pays for a 64-row tile holding one query's heads: the cost of the guarantee. Every
    block runs masked (SPLIT off): whether a block falls before a tile's diagonal depends on
    the tile, and the unmasked code may contract its floating-point operations otherwise."""
    supports_bidirectional = False  # its launches take no CAUSAL switch
    splits_long_decodes = False  # a split would change a row's sums with its batch

    name = "triton_invariant"
    BLOCK_M = 64
    HEAD_MAJOR_PAGES = False  # the invariant mode keeps one layout (batch_invariant.py's views)

    @classmethod
    def tile_q(cls, group: int) -> int:
        return max(1, cls.BLOCK_M // group)

    @classmethod
    def forward(cls, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                alibi_slopes: torch.Tensor | None = None, sliding_window: int | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None, causal: bool = True):
        cls.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(q)
        hkv = k.shape[1]
        args, common = cls._launch_args(q, k_cache, v_cache, out, meta, scale, alibi_slopes,
                                        sliding_window, k_scale, v_scale, logits_soft_cap, sinks)
        common.update(BLOCK_M=cls.BLOCK_M, SPLIT=False, **cls.PREFILL_LAUNCH)
        slopes = q if alibi_slopes is None else alibi_slopes
        if meta.num_decode:
            _paged_attention_kernel[(meta.num_decode, hkv)](
                *args, meta.q_start, meta.q_start, slopes, TILE_Q=1, DIRECT=True, **common)
        if meta.num_prefill_tiles:
            _paged_attention_kernel[(meta.num_prefill_tiles, hkv)](
                *args, meta.prefill_tiles[0], meta.prefill_tiles[1], slopes,
                TILE_Q=meta.prefill_tile_q, DIRECT=False, **common)
        return out
