"""The routed experts of a decode step of one or two tokens (CUDA): matrix-vector products, no pair
alignment, no separate routing or k-row sum.

At batch 1 the fused path (fused_moe.py) spends a step's MoE layer on four launches around
its two products: route_align (softmax, top k, and a histogram and sort that lay 8 pairs
out in blocks of 16 rows), the grouped gate|up GEMM whose tensor-core tiles are 15/16
padding, the down GEMM, and the sum of the k rows. On an H200 (Qwen3-30B-A3B shape,
profile in benchmarks/results/2026-12-06-gpu-h200-profile-moe-b1-*) route_align took 5.5 us
a layer and torch's k-row sum 4.8 us, beside 15.3 us for gate|up and 9.0 for down.

Here a token's k experts take two kernels:

1. `_gate_up_kernel`, a program per (pair, BN intermediate rows): with `logits` it
   computes the token's routing itself (softmax in float32, top k with the lowest index
   among ties, optional renormalisation: _route_kernel's arithmetic, so the same experts
   and weights), and the program of the first row block stores the pair's expert id and
   weight for the down kernel; otherwise it reads given ids. It walks the hidden size in
   tiles of up to 1,024, gate and up rows together, element-wise products into float32
   (skinny_gemm's pattern: the next tile loaded before the current one is summed), and
   writes silu(gate) * up (gpt-oss: its biases and clamped SwiGLU) in the input dtype.
2. `_down_kernel`, a program per (token, BN output columns): all k experts' rows at
   once, a [KB, BN, BK] tile a step (so the loads of the k experts are in flight
   together: an earlier kernel that took them one after another made the step 1.48x
   slower), each expert's sum scaled by its weight and the k summed in float32 before
   the one rounding to the output dtype.

The result differs from the fused path's only in rounding: that path rounds each
expert's weighted row to the output dtype before summing the k rows.

Used for steps of up to MAX_TOKENS tokens (PAGEDLLM_MOE_SKINNY_TOKENS, default 2; 0 off)
of bf16/fp16 experts stored as floats (MXFP4 experts keep the fused path), outside the
batch-invariant mode."""

from __future__ import annotations

import os

import torch

from pagedllm import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch it
    triton = None

# H100, gpu-moe: at 2 sequences +1.6% (a0e1b8c) and +4.1% with the final tiles (40803d5);
# at 4, -4.3% (the fused path's tiles win)
DEFAULT_MAX_TOKENS = 2
_DTYPES = (torch.bfloat16, torch.float16)


# read once: applies() and launch_config() run for every MoE layer of an eager step
MAX_TOKENS = int(os.environ.get("PAGEDLLM_MOE_SKINNY_TOKENS", DEFAULT_MAX_TOKENS))
_CONFIG_OVERRIDE = os.environ.get("PAGEDLLM_MOE_SKINNY_CONFIG")  # "gBN,gBK,dBN,dBK" (benchmarks)


def applies(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether a step of `x` [T, H] takes these kernels: 1 <= T <= MAX_TOKENS, on CUDA,
    float experts in x's 16-bit dtype with unit stride
    along their last dimension."""
    if triton is None or not x.is_cuda or x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    tokens = x.shape[0]
    return (0 < tokens <= MAX_TOKENS and x.stride(-1) == 1 and w13.stride(-1) == 1
            and w2.stride(-1) == 1)


def launch_config(hidden: int, inter: int) -> dict:
    """Tile settings: gate|up 4 rows x up to 1,024 of the hidden size a step, down one
    column x up to 128 of the intermediate size for all k experts at once; 4 warps (the
    fastest of the H100 sweep, benchmarks/results/2026-12-07-gpu-h100-skinny-moe-*.json).
    PAGEDLLM_MOE_SKINNY_CONFIG="gBN,gBK,dBN,dBK" overrides (benchmarks)."""
    cfg = {"gate_bn": 4 if inter >= 512 else 2, "gate_bk": min(1024, triton.next_power_of_2(max(hidden, 64))),
           "down_bn": 1, "down_bk": min(128, triton.next_power_of_2(max(inter, 64))), "num_warps": 4}
    if _CONFIG_OVERRIDE:
        gbn, gbk, dbn, dbk = (int(v) for v in _CONFIG_OVERRIDE.split(","))
        cfg.update(gate_bn=gbn, gate_bk=gbk, down_bn=dbn, down_bk=dbk)
    return cfg


def routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                   logits: torch.Tensor | None = None, top_k: int | None = None,
                   renormalise: bool = False, weights_dtype: torch.dtype = torch.float32,
                   weights: torch.Tensor | None = None, ids: torch.Tensor | None = None,
                   b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                   swiglu: tuple[float, float] | None = None,
                   config: dict | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t))), e = ids[t, j], for x
    [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. Either router `logits`
    [T, E] with `top_k` and `renormalise` (routed here; weights kept in `weights_dtype`, as
    the model casts them) or `weights` / `ids` [T, k] from another routing."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    dev = x.device
    route = logits is not None
    if route:
        if top_k is None:
            raise ValueError("routed_experts: logits need top_k")
        ids = torch.empty((tokens, top_k), dtype=torch.int32, device=dev)
        weights = torch.empty((tokens, top_k), dtype=weights_dtype, device=dev)
    elif weights is None or ids is None:
        raise ValueError("routed_experts takes logits, or weights and ids")
    else:
        top_k = ids.shape[1]
        ids, weights = ids.contiguous(), weights.contiguous()
    cfg = config or launch_config(hidden, inter)
    pairs = tokens * top_k
    h = torch.empty((pairs, inter), dtype=x.dtype, device=dev)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=dev)
    alpha, limit = swiglu or (1.0, 0.0)
    opts = pdl.kernel_options(x)
    lg = logits if route else x  # any pointer when unused
    _gate_up_kernel[(pairs, triton.cdiv(inter, cfg["gate_bn"]))](
        x, w13, w13 if b13 is None else b13, h, lg, ids, weights, num_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0), lg.stride(0),
        h.stride(0), float(alpha), float(limit), K=top_k, EB=triton.next_power_of_2(num_experts), ROUTE=route,
        RENORM=renormalise, BIAS=b13 is not None, SWIGLU=swiglu is not None, BN=cfg["gate_bn"],
        BK=cfg["gate_bk"], num_warps=cfg["num_warps"], **opts)
    _down_kernel[(tokens, triton.cdiv(hidden, cfg["down_bn"]))](
        h, w2, w2 if b2 is None else b2, out, ids, weights, inter, hidden, h.stride(0), w2.stride(0),
        w2.stride(1), 0 if b2 is None else b2.stride(0), out.stride(0), K=top_k, KB=triton.next_power_of_2(top_k),
        BIAS=b2 is not None, BN=cfg["down_bn"], BK=cfg["down_bk"], num_warps=cfg["num_warps"], **opts)
    return out


if triton is not None:
    from pagedllm.model_executor.layers.moe_math import expert_activation, router_probs, take_best
    from pagedllm.pdl import launch_dependents, wait

    @triton.jit
    def _topk_pick(Logits, E, j, K: tl.constexpr, EB: tl.constexpr, RENORM: tl.constexpr):
        """Expert and weight of a token's j-th choice (Logits: its row): _route_kernel's
        softmax and top K (moe_math), renormalised over the K when RENORM."""
        left, eb = router_probs(Logits, E, EB)
        total = 0.0
        pick = 0
        weight = 0.0
        for i in tl.static_range(K):
            best, idx, left = take_best(left, eb, EB)
            pick = tl.where(j == i, idx, pick)
            weight = tl.where(j == i, best, weight)
            total += best
        if RENORM:
            weight = weight / total
        return pick, weight

    @triton.jit
    def _gate_up_kernel(X, W, B, Hout, Logits, Ids, Weights, E, H, N, sxm, swe, swn, sbe, slt, shm,
                        alpha, limit, K: tl.constexpr, EB: tl.constexpr, ROUTE: tl.constexpr,
                        RENORM: tl.constexpr, BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
        pair = tl.program_id(0)
        pn = tl.program_id(1)
        if PDL:  # placed early (pagedllm.pdl): the logits or ids come from the kernel before
            tok = wait()
            X += tok
            Hout += tok
            Logits += tok
            Ids += tok
            Weights += tok
            launch_dependents()
        t = pair // K
        if ROUTE:
            e, wt = _topk_pick(Logits + t.to(tl.int64) * slt, E, pair % K, K, EB, RENORM)
            if pn == 0:  # one program of the pair tells the down kernel
                tl.store(Ids + pair, e)
                tl.store(Weights + pair, wt.to(Weights.dtype.element_ty))
        else:
            e = tl.load(Ids + pair)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        nin = rn < N
        g_ptr = W + e.to(tl.int64) * swe + rn[:, None].to(tl.int64) * swn + rk[None, :]
        u_ptr = g_ptr + N * swn
        x_ptr = X + t.to(tl.int64) * sxm + rk
        wmask = nin[:, None] & (rk < H)[None, :]
        g = tl.load(g_ptr, mask=wmask, other=0.0)
        u = tl.load(u_ptr, mask=wmask, other=0.0)
        acc_g = tl.zeros((BN,), dtype=tl.float32)
        acc_u = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, H, BK):
            a = tl.load(x_ptr + k0, mask=rk + k0 < H, other=0.0).to(tl.float32)
            nmask = nin[:, None] & (rk + (k0 + BK) < H)[None, :]
            g_next = tl.load(g_ptr + (k0 + BK), mask=nmask, other=0.0)
            u_next = tl.load(u_ptr + (k0 + BK), mask=nmask, other=0.0)
            acc_g += tl.sum(g.to(tl.float32) * a[None, :], 1)
            acc_u += tl.sum(u.to(tl.float32) * a[None, :], 1)
            g = g_next
            u = u_next
        if BIAS:  # B: [E, 2I], gate biases then up biases
            acc_g += tl.load(B + e * sbe + rn, mask=nin, other=0.0).to(tl.float32)
            acc_u += tl.load(B + e * sbe + N + rn, mask=nin, other=0.0).to(tl.float32)
        out = expert_activation(acc_g, acc_u, alpha, limit, SWIGLU)
        tl.store(Hout + pair.to(tl.int64) * shm + rn, out.to(Hout.dtype.element_ty), mask=nin)

    @triton.jit
    def _down_kernel(A, W, B, Out, Ids, Weights, Inter, N, sam, swe, swn, sbe, som, K: tl.constexpr,
                     KB: tl.constexpr, BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pn = tl.program_id(1)
        if PDL:  # the gate|up kernel wrote A (and the ids and weights, when it routed)
            tok = wait()
            A += tok
            Out += tok
            Ids += tok
            Weights += tok
            launch_dependents()
        kk = tl.arange(0, KB)
        kin_e = kk < K
        e = tl.load(Ids + t * K + kk, mask=kin_e, other=0).to(tl.int64)
        wt = tl.load(Weights + t * K + kk, mask=kin_e, other=0.0).to(tl.float32)
        rn = pn * BN + tl.arange(0, BN)
        nin = rn < N
        rk = tl.arange(0, BK)
        w_ptr = W + e[:, None, None] * swe + rn[None, :, None].to(tl.int64) * swn + rk[None, None, :]
        a_ptr = A + (t * K + kk)[:, None] * sam + rk[None, :]
        row_mask = kin_e[:, None, None] & nin[None, :, None]
        w = tl.load(w_ptr, mask=row_mask & (rk < Inter)[None, None, :], other=0.0)
        acc = tl.zeros((KB, BN), dtype=tl.float32)
        for k0 in range(0, Inter, BK):
            a = tl.load(a_ptr + k0, mask=kin_e[:, None] & (rk + k0 < Inter)[None, :], other=0.0)
            w_next = tl.load(w_ptr + (k0 + BK), mask=row_mask & (rk + (k0 + BK) < Inter)[None, None, :],
                             other=0.0)
            acc += tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], 2)
            w = w_next
        if BIAS:
            acc += tl.load(B + e[:, None] * sbe + rn[None, :], mask=kin_e[:, None] & nin[None, :],
                           other=0.0).to(tl.float32)
        out = tl.sum(acc * wt[:, None], 0)
        tl.store(Out + t * som + rn, out.to(Out.dtype.element_ty), mask=nin)
