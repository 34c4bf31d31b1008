"""Fused Mixture-of-Experts on CUDA (Triton): only the routed experts' weights are read, no
host synchronisation and no data-dependent shapes, so the same kernels run eagerly and
inside CUDA graphs.

A step's T tokens each chose k experts: T*k (token, expert) pairs.

1. `align_pairs` sorts the pairs by expert on the device and lays each expert's pairs out
   in segments padded to a multiple of BLOCK_M, so that every block of BLOCK_M rows
   belongs to one expert. The buffers have the worst case's size (T*k plus BLOCK_M - 1 of
   padding per expert that can occur); how much of them is used is a device scalar the
   kernels read, so nothing waits for the host and a CUDA graph can replay the step.
2. `_gate_up_kernel`: one grouped GEMM over the blocks. A program takes one block (one
   expert, BLOCK_M pairs gathered from x by token) and BLOCK_N columns of the expert's
   intermediate size, multiplies by the gate and the up rows of that expert together (two
   accumulators over the same x tile) and writes silu(gate) * up: the [T*k, 2I] gate|up
   product never reaches memory. gpt-oss adds each expert's gate and up biases and applies
   its clamped SwiGLU instead (BIAS and SWIGLU are compile-time switches, so other models
   run the kernel they had).
3. `_down_kernel`: the second grouped GEMM, [T*k, I] by each block's expert's down
   projection (plus its bias, for gpt-oss), every row scaled by its routing weight.
   gpt-oss's MXFP4 experts can stay packed (MXFP4, a third switch): each K tile of a weight
   is read as bytes and exponents and dequantized in registers before its dot product.
4. The k rows of a token are summed (a [T, k, H] reduction; `sum_k`, which has a kernel of
   its own for decode-sized steps, off until measured).

   At batch 1 these are small launches among some 600 a step. Two ways of saving
   some were measured on an H200 (gpu-moe, batch 1) and dropped: one kernel for the down
   projection and the sum (a program a token, the k experts in turn) made the step 1.48x
   slower, its programs waiting on one expert's weights after another; leaving the k
   rows for the next fused residual add + RMSNorm to sum (no reduction launch) changed
   nothing measurable (249 against 253 tok/s, with the routing weights' cast also folded
   into route_align, which stays).

Programs whose block lies past the used length return at once, so a decode step with 8
pairs over 128 experts reads 8 experts' weights, not 128.

Tile sizes come from `configs/fused_moe.json` (tuned per shape by
benchmarks/tune_fused_moe.py on the card named there), else a heuristic by pairs per
expert.
"""

from __future__ import annotations

import functools
import json
import os

import torch

try:
    import triton
    import triton.language as tl

    from pagedllm import pdl
    from pagedllm.model_executor.layers import skinny_moe
    from pagedllm.model_executor.layers.moe_math import expert_activation, router_probs, take_best
    from pagedllm.pdl import launch_dependents, wait
    from pagedllm.triton_dot import dot
except ImportError:  # CPU-only installs: callers check `available()`
    triton = None

CONFIG_FILE = os.path.join(os.path.dirname(__file__), "configs", "fused_moe.json")


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


SMALL_PAIRS = 4096  # up to this many pairs, one kernel aligns them (decode steps)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _align_cap(pairs: int, num_experts: int, block_m: int) -> int:
    """The worst-case padded length: every pair, plus BLOCK_M - 1 rows of padding for each
    expert that can get a pair, rounded up to whole blocks."""
    cap = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-cap // block_m) * block_m


def _align_buffers(pairs: int, num_experts: int, block_m: int, device) -> tuple[int, tuple[torch.Tensor, ...], dict]:
    """(the padded length; the empty buffers the one-program alignment fills: sorted ids,
    expert per block, rows used, an expert-sized scratch; and _align_body's block sizes)."""
    cap = _align_cap(pairs, num_experts, block_m)
    eb = _pow2(num_experts + 1)
    buffers = (torch.empty(cap, dtype=torch.int32, device=device),
               torch.empty(cap // block_m, dtype=torch.int32, device=device),
               torch.empty(1, dtype=torch.int32, device=device),
               torch.empty(eb, dtype=torch.int32, device=device))
    return cap, buffers, {"BM": block_m, "PB": max(16, _pow2(pairs)), "EB": eb,
                          "NB": max(16, _pow2(cap // block_m))}


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int,
                one_kernel: bool | None = None) -> tuple[torch.Tensor, ...]:
    """(sorted pair ids [P] int32, expert of each block [P / block_m] int32, rows used [1]
    int32), P = the worst-case padded length. Pair p is token p // k's j-th choice
    (p = token * k + j); padding slots hold T*k (no pair). `one_kernel`: None picks the
    single-kernel path on CUDA for up to SMALL_PAIRS pairs, torch ops otherwise."""
    pairs = ids.numel()
    if one_kernel is None:
        one_kernel = triton is not None and ids.is_cuda and pairs <= SMALL_PAIRS
    if one_kernel:
        cap, (sorted_ids, block_expert, used, scratch), sizes = _align_buffers(pairs, num_experts, block_m,
                                                                                ids.device)
        _align_small_kernel[(1,)](ids.reshape(-1), sorted_ids, block_expert, used, scratch, pairs,
                                  num_experts, cap, **sizes, num_warps=8)
        return sorted_ids, block_expert, used
    return _align_with_torch(ids, num_experts, block_m, _align_cap(pairs, num_experts, block_m))


def _align_with_torch(ids: torch.Tensor, num_experts: int, block_m: int, cap: int) -> tuple[torch.Tensor, ...]:
    """align_pairs in torch ops (any device; many pairs): still no host synchronisation."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded  # where each expert's segment begins
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin once sorted
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(pairs, device=dev) - first[e_sorted]
    sorted_ids = torch.full((cap,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, starts[e_sorted] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, cap, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


if triton is not None:

    @triton.jit
    def _block(SortedIds, BlockExpert, Used, num_pairs, N, BM: tl.constexpr, BN: tl.constexpr):
        """This program's block of pairs and column tile: (inside the used length, expert,
        pair ids [BM], which are pairs, column tile index)."""
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BN)
        blk = pid // n_tiles
        live = blk * BM < tl.load(Used)
        e = tl.load(BlockExpert + blk).to(tl.int64)
        pair = tl.load(SortedIds + blk * BM + tl.arange(0, BM))
        return live, e, pair, pair < num_pairs, pid % n_tiles

    @triton.jit
    def _e2m1(c):
        """The values of 4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit)."""
        c = c.to(tl.int32)
        e = (c >> 1) & 3
        m = (c & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
        return tl.where((c & 8) != 0, -mag, mag)

    @triton.jit
    def _mxfp4_tile(W, S, rn, k0, K, N, swn, ssn, DTYPE: tl.constexpr, BK: tl.constexpr,
                    BN: tl.constexpr):
        """Inputs k0 .. k0+BK of rows `rn` of one expert's MXFP4 [N, K] weight (W: its bytes,
        two values each, low nibble first; S: one e8m0 exponent per 32 values) as a [BK, BN]
        tile of DTYPE values. BK is a multiple of 32."""
        rn64 = rn.to(tl.int64)
        n_ok = rn < N
        rb = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(W + rn64[:, None] * swn + rb[None, :],
                         mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
        vals = tl.interleave(_e2m1(packed & 15), _e2m1(packed >> 4))  # [BN, BK]
        rs = k0 // 32 + tl.arange(0, BK // 32)
        sc = tl.load(S + rn64[:, None] * ssn + rs[None, :], mask=n_ok[:, None] & (rs < K // 32)[None, :],
                     other=127)
        scale = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(sc - 127), exactly
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, BK // 32, 32)), (BN, BK))
        return tl.trans(vals * scale).to(DTYPE)

    @triton.jit
    def _gate_up_kernel(X, W, S, B, Out, SortedIds, BlockExpert, Used, num_pairs, H, N, top_k,
                        sxm, sxk, swe, swn, swk, sse, ssn, sbe, som, son, alpha, limit,
                        IEEE: tl.constexpr, BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                        MXFP4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        live, e, pair, valid, pn = _block(SortedIds, BlockExpert, Used, num_pairs, N, BM, BN)
        if not live:
            return
        tok = (pair // top_k).to(tl.int64)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_ptr = X + tok[:, None] * sxm + rk[None, :] * sxk
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        if MXFP4:  # packed weights, dequantized tile by tile
            for k0 in range(0, H, BK):
                a = tl.load(a_ptr, mask=valid[:, None] & (rk + k0 < H)[None, :], other=0.0)
                g = _mxfp4_tile(W + e * swe, S + e * sse, rn, k0, H, N, swn, ssn, X.dtype.element_ty, BK, BN)
                u = _mxfp4_tile(W + e * swe + N * swn, S + e * sse + N * ssn, rn, k0, H, N, swn, ssn,
                                X.dtype.element_ty, BK, BN)
                acc_g = dot(a, g, acc_g, IEEE)
                acc_u = dot(a, u, acc_u, IEEE)
                a_ptr += BK * sxk
        else:
            g_ptr = W + e * swe + rn[None, :].to(tl.int64) * swn + rk[:, None] * swk
            u_ptr = g_ptr + N * swn
            for k0 in range(0, H, BK):
                kin = rk + k0 < H
                a = tl.load(a_ptr, mask=valid[:, None] & kin[None, :], other=0.0)
                wmask = kin[:, None] & (rn[None, :] < N)
                g = tl.load(g_ptr, mask=wmask, other=0.0)
                u = tl.load(u_ptr, mask=wmask, other=0.0)
                acc_g = dot(a, g, acc_g, IEEE)
                acc_u = dot(a, u, acc_u, IEEE)
                a_ptr += BK * sxk
                g_ptr += BK * swk
                u_ptr += BK * swk
        if BIAS:  # B: [E, 2I], gate biases then up biases
            acc_g += tl.load(B + e * sbe + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(B + e * sbe + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        h = expert_activation(acc_g, acc_u, alpha, limit, SWIGLU)  # gpt-oss: its clamped SwiGLU
        o_ptr = Out + pair[:, None].to(tl.int64) * som + rn[None, :] * son
        tl.store(o_ptr, h.to(Out.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))

    @triton.jit
    def _down_kernel(A, W, S, B, Out, SortedIds, BlockExpert, Used, Weights, num_pairs, K, N,
                     sam, sak, swe, swn, swk, sse, ssn, sbe, som, son, IEEE: tl.constexpr,
                     BIAS: tl.constexpr, MXFP4: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        live, e, pair, valid, pn = _block(SortedIds, BlockExpert, Used, num_pairs, N, BM, BN)
        if not live:
            return
        rows = pair.to(tl.int64)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_ptr = A + rows[:, None] * sam + rk[None, :] * sak
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if MXFP4:
            for k0 in range(0, K, BK):
                a = tl.load(a_ptr, mask=valid[:, None] & (rk + k0 < K)[None, :], other=0.0)
                w = _mxfp4_tile(W + e * swe, S + e * sse, rn, k0, K, N, swn, ssn, A.dtype.element_ty, BK, BN)
                acc = dot(a, w, acc, IEEE)
                a_ptr += BK * sak
        else:
            w_ptr = W + e * swe + rn[None, :].to(tl.int64) * swn + rk[:, None] * swk
            for k0 in range(0, K, BK):
                kin = rk + k0 < K
                a = tl.load(a_ptr, mask=valid[:, None] & kin[None, :], other=0.0)
                w = tl.load(w_ptr, mask=kin[:, None] & (rn[None, :] < N), other=0.0)
                acc = dot(a, w, acc, IEEE)
                a_ptr += BK * sak
                w_ptr += BK * swk
        if BIAS:
            acc += tl.load(B + e * sbe + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        wt = tl.load(Weights + rows, mask=valid, other=0.0).to(tl.float32)
        acc = acc * wt[:, None]
        o_ptr = Out + rows[:, None] * som + rn[None, :] * son
        tl.store(o_ptr, acc.to(Out.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < N))

    @triton.jit
    def _align_body(Ids, SortedIds, BlockExpert, Used, Scratch, P, E, CAP,
                    BM: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr, NB: tl.constexpr):
        """align_pairs in one program, for up to PB pairs: a histogram of the experts, the
        padded segment of each, one sort of (expert, pair) keys and a scatter."""
        offs = tl.arange(0, PB)
        valid = offs < P
        e = tl.load(Ids + offs, mask=valid, other=E).to(tl.int32)  # no pair: bucket E
        eb = tl.arange(0, EB)
        counts = tl.where(eb < E, tl.histogram(e, EB), 0)
        padded = (counts + BM - 1) // BM * BM
        ends = tl.cumsum(padded, 0)
        first = tl.cumsum(counts, 0) - counts
        tl.store(Scratch + eb, ends - padded - first)  # sorted index -> padded slot shift
        tl.store(Used, tl.sum(padded, 0))
        for c0 in range(0, CAP, PB):
            tl.store(SortedIds + c0 + offs, P, mask=c0 + offs < CAP)
        nb = tl.arange(0, NB)
        expert = tl.sum((ends[None, :] <= (nb * BM)[:, None]).to(tl.int32), 1)
        tl.store(BlockExpert + nb, tl.minimum(expert, E - 1), mask=nb * BM < CAP)
        tl.debug_barrier()
        key = tl.sort(e * PB + offs)  # by expert, then by pair: stable
        se = key // PB
        shift = tl.load(Scratch + se, mask=se < E, other=0)
        tl.store(SortedIds + shift + offs, key % PB, mask=se < E)

    @triton.jit
    def _align_small_kernel(Ids, SortedIds, BlockExpert, Used, Scratch, P, E, CAP,
                            BM: tl.constexpr, PB: tl.constexpr, EB: tl.constexpr,
                            NB: tl.constexpr):
        _align_body(Ids, SortedIds, BlockExpert, Used, Scratch, P, E, CAP, BM, PB, EB, NB)

    @triton.jit
    def _route_align_kernel(Logits, Weights, Ids, SortedIds, BlockExpert, Used, Scratch, T, E, stride,
                            CAP, K: tl.constexpr, KB: tl.constexpr, TB: tl.constexpr, EB: tl.constexpr,
                            RENORM: tl.constexpr, BM: tl.constexpr, PB: tl.constexpr,
                            NB: tl.constexpr):
        """_route_kernel for every token of a small step at once ([TB, EB] logits in one
        program), then align_pairs on the ids it wrote: one launch where there were two.
        The weights are stored once, in Weights' dtype, after the float32 renormalisation
        (transformers casts them to the activations' dtype after it; a separate cast would
        be one more launch)."""
        t = tl.arange(0, TB)
        eb = tl.arange(0, EB)
        kk = tl.arange(0, KB)
        t_ok = t < T
        x = tl.load(Logits + t[:, None].to(tl.int64) * stride + eb[None, :],
                    mask=t_ok[:, None] & (eb < E)[None, :], other=float("-inf")).to(tl.float32)
        x = tl.where(t_ok[:, None], x, 0.0)  # rows past T: finite, never stored
        p = tl.exp(x - tl.max(x, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        left = tl.where((eb < E)[None, :], p, -1.0)
        chosen = tl.zeros([TB, KB], dtype=tl.float32)
        total = tl.zeros([TB], dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(left, 1)
            idx = tl.min(tl.where(left == best[:, None], eb[None, :], EB), 1)  # lowest among ties
            tl.store(Ids + t * K + j, idx, mask=t_ok)
            chosen = tl.where(kk[None, :] == j, best[:, None], chosen)
            total += best
            left = tl.where(eb[None, :] == idx[:, None], -1.0, left)
        if RENORM:
            chosen = chosen / total[:, None]
        tl.store(Weights + t[:, None] * K + kk[None, :], chosen.to(Weights.dtype.element_ty),
                 mask=t_ok[:, None] & (kk < K)[None, :])
        tl.debug_barrier()
        _align_body(Ids, SortedIds, BlockExpert, Used, Scratch, T * K, E, CAP, BM, PB, EB, NB)

    @triton.jit
    def _sum_k_kernel(Rows, Out, H, K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
        """Out[t] = the sum of Rows[t, 0..K) in float32, BLOCK columns a program."""
        if PDL:  # placed early (pagedllm.pdl): wait for the down projection, let the next be placed
            tok = wait()
            Rows += tok
            Out += tok
            launch_dependents()
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        j = tl.arange(0, KB)
        mask = (j < K)[:, None] & (c < H)[None, :]
        x = tl.load(Rows + (t * K + j)[:, None] * H + c[None, :], mask=mask, other=0.0)
        tl.store(Out + t * H + c, tl.sum(x.to(tl.float32), 0).to(Out.dtype.element_ty), mask=c < H)

    @triton.jit
    def _route_kernel(Logits, Weights, Ids, E, stride, K: tl.constexpr, EB: tl.constexpr,
                      RENORM: tl.constexpr):
        """Softmax over one token's router logits in float32, its top K, and (RENORM) the
        K weights divided by their sum: transformers' routing in one kernel."""
        t = tl.program_id(0).to(tl.int64)
        left, eb = router_probs(Logits + t * stride, E, EB)
        total = 0.0
        for j in tl.static_range(K):
            best, idx, left = take_best(left, eb, EB)  # the lowest index among ties
            tl.store(Weights + t * K + j, best)
            tl.store(Ids + t * K + j, idx)
            total += best
        if RENORM:
            kk = tl.arange(0, K)
            w = tl.load(Weights + t * K + kk)
            tl.store(Weights + t * K + kk, w / total)


@functools.lru_cache(maxsize=1)
def _tuned() -> dict:
    try:
        with open(CONFIG_FILE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int, mxfp4: bool = False) -> str:
    return f"E={num_experts},H={hidden},I={inter},k={top_k}" + (",mxfp4" if mxfp4 else "")


def pick_config(pairs: int, num_experts: int, hidden: int, inter: int, top_k: int,
                mxfp4: bool = False) -> dict:
    """Tile sizes for one call: the tuned entry for this shape (and weight format) at the
    nearest tuned token count, else by the number of pairs each expert gets on average."""
    table = _tuned().get(shape_key(num_experts, hidden, inter, top_k, mxfp4))
    tokens = max(1, pairs // top_k)
    counts = [t for t in (table or {}) if t.isdigit()]  # "_card": where it was tuned
    if counts:
        best = min(counts, key=lambda t: abs(int(t) - tokens))
        return dict(table[best])
    per_expert = pairs / num_experts
    if per_expert <= 2:
        return {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 3}
    if per_expert <= 32:
        return {"BM": 32, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
    return {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3}


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int32 expert ids [T, k]) from router logits [T, E]: softmax
    in float32, top k, optionally renormalised to sum to one, in one kernel."""
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), K=top_k,
                                 EB=_pow2(experts), RENORM=renormalise)
    return weights, ids


ROUTE_ALIGN_TOKENS = 64  # up to this many tokens, one program routes and aligns (decode steps)


def route_align(logits: torch.Tensor, top_k: int, renormalise: bool, block_m: int,
                dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """route() and align_pairs() of its ids in one single-program launch, for steps of at
    most ROUTE_ALIGN_TOKENS tokens: (weights, ids, (sorted ids, expert per block, rows
    used)), the same values the two calls give, the weights cast to `dtype` after the
    float32 renormalisation. Not for the batch-invariant mode: a token's softmax sum is
    reduced in another order here than in route()."""
    tokens, experts = logits.shape
    if not 0 < tokens <= ROUTE_ALIGN_TOKENS:
        raise ValueError(f"route_align takes 1 to {ROUTE_ALIGN_TOKENS} tokens, got {tokens}")
    dev = logits.device
    weights = torch.empty((tokens, top_k), dtype=dtype, device=dev)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=dev)
    pairs = tokens * top_k
    cap, (sorted_ids, block_expert, used, scratch), sizes = _align_buffers(pairs, experts, block_m, dev)
    _route_align_kernel[(1,)](logits, weights, ids, sorted_ids, block_expert, used, scratch, tokens,
                              experts, logits.stride(0), cap, K=top_k, KB=_pow2(top_k),
                              TB=max(2, _pow2(tokens)), RENORM=renormalise, **sizes, num_warps=8)
    return weights, ids, (sorted_ids, block_expert, used)


# The batch-invariant mode's one configuration: a pair's row is then the same K-ordered
# sum in any batch (the tuned tiles change with the token count).
INVARIANT_CONFIG = {"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}


# Up to this many tokens the k rows may be summed by _sum_k_kernel instead of torch (on an
# H200 at batch 1 torch's reduction over the middle dimension took 4.8 us a layer). Off (0)
# until a GPU run shows it faster: PAGEDLLM_MOE_SUM_K_TOKENS=64 turns it on for steps of up
# to 64 tokens (gpu_run.sh skinny measures both).
SUM_K_TOKENS = int(os.environ.get("PAGEDLLM_MOE_SUM_K_TOKENS", "0"))


def sum_k(rows: torch.Tensor, max_tokens: int | None = None) -> torch.Tensor:
    """rows [T, k, H] summed over k, in float32 with one rounding as torch's sum: by the
    kernel for up to `max_tokens` tokens (default SUM_K_TOKENS) of contiguous rows on CUDA
    (or in Triton's interpreter), by torch otherwise."""
    tokens, top_k, hidden = rows.shape
    limit = SUM_K_TOKENS if max_tokens is None else max_tokens
    kernel = rows.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if tokens > limit or not rows.is_contiguous() or triton is None or not kernel:
        return rows.sum(1)
    out = torch.empty((tokens, hidden), dtype=rows.dtype, device=rows.device)
    block = min(256, _pow2(hidden))
    _sum_k_kernel[(tokens, triton.cdiv(hidden, block))](
        rows, out, hidden, K=top_k, KB=_pow2(top_k), BLOCK=block, num_warps=4,
        **pdl.kernel_options(rows))
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, config: dict | None = None, invariant: bool = False,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  swiglu: tuple[float, float] | None = None, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None,
                  aligned: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j], for
    x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. `invariant`: one
    fixed tile configuration and the k rows summed in order (batch-invariant mode).
    gpt-oss: biases b13 [E, 2I] (gate then up) and b2 [E, H], and `swiglu` = (alpha,
    limit) for its clamped SwiGLU in place of silu(gate) * up. MXFP4 experts (gpt-oss's
    published format, kept packed): w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8 (two e2m1
    values a byte, low nibble first) with w13_scale [E, 2I, H/32] and w2_scale [E, H, I/32]
    (uint8 e8m0 exponents, one per 32 values), dequantized tile by tile in the kernels.
    `aligned`: the pairs already aligned (route_align) with `config`'s BM. A step of 1-2 tokens
    of float experts without either takes skinny_moe's matrix-vector kernels instead."""
    if invariant:
        config = INVARIANT_CONFIG
    elif w13_scale is None and aligned is None and config is None and skinny_moe.applies(x, w13, w2):
        return skinny_moe.routed_experts(x, w13, w2, weights=weights, ids=ids, b13=b13, b2=b2, swiglu=swiglu)
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = ids.shape[1]
    pairs = tokens * top_k
    mxfp4 = w13_scale is not None
    cfg = config or pick_config(pairs, num_experts, hidden, inter, top_k, mxfp4)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    if mxfp4:
        bk = max(bk, 32)  # whole scale blocks per K tile
    launch = {"num_warps": cfg.get("num_warps", 4), "num_stages": cfg.get("num_stages", 3)}
    ieee = x.dtype == torch.float32
    if aligned is None:
        aligned = align_pairs(ids, num_experts, bm)
    sorted_ids, block_expert, used = aligned
    blocks = sorted_ids.numel() // bm
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    alpha, limit = swiglu or (1.0, 0.0)
    s13 = w13 if w13_scale is None else w13_scale  # any pointer when unused
    _gate_up_kernel[(blocks * triton.cdiv(inter, bn),)](
        x, w13, s13, w13 if b13 is None else b13, h, sorted_ids, block_expert, used, pairs, hidden,
        inter, top_k, *x.stride(), *w13.stride(), *s13.stride()[:2], 0 if b13 is None else b13.stride(0),
        *h.stride(), float(alpha), float(limit), IEEE=ieee, BIAS=b13 is not None,
        SWIGLU=swiglu is not None, MXFP4=mxfp4, BM=bm, BN=bn, BK=bk, **launch)
    flat_w = weights.reshape(-1)
    out = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    s2 = w2 if w2_scale is None else w2_scale
    _down_kernel[(blocks * triton.cdiv(hidden, bn),)](
        h, w2, s2, w2 if b2 is None else b2, out, sorted_ids, block_expert, used, flat_w, pairs, inter,
        hidden, *h.stride(), *w2.stride(), *s2.stride()[:2], 0 if b2 is None else b2.stride(0),
        *out.stride(), IEEE=ieee, BIAS=b2 is not None, MXFP4=mxfp4, BM=bm, BN=bn, BK=bk, **launch)
    rows = out.view(tokens, top_k, hidden)
    if not invariant:
        return sum_k(rows)
    total = rows[:, 0]
    for j in range(1, top_k):  # in order: a reduction kernel's split depends on the size
        total = total + rows[:, j]
    return total
