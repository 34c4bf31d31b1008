"""The sampler's draw in two Triton kernels (CUDA): temperature, softmax and inverse-CDF
draw of every row without writing a probability or a CDF tensor.

The tensor-op path (sampler._probs, then _draw) runs five full-vocabulary kernels a step
(divide by temperature, softmax, cumsum, searchsorted, and the float copy before them);
on an H100 at 512 rows of a 128k vocabulary they took about 1.35 ms a step, 7% of a
trt-8b-2k decode's device time (benchmarks/results/2026-12-07-gpu-h100-profile-trt-8b-2k-
5c50e23.json). Here the first kernel reads each row once, in splits of SPLIT tokens
(rows x splits programs, so a batch of one still fills the card), and keeps each split's
maximum and sum of exp((x - max) / T); the second, one program a row, combines them,
finds the split where the row's cumulative weight passes u * total, and scans only that
split for the token. About one read of the logits instead of seven passes.

The draw is the same as the tensor-op path's: token i wins for cdf[i-1] <= u * total <
cdf[i] over the weights exp((x - max) / T); only float rounding differs (sums in another
order), so a u within rounding of a boundary may land on the neighbour. A token of zero
weight (a -inf logit) is never drawn; if rounding leaves u * total past the last sum, the
last token of nonzero weight is taken. The splits are fixed by the vocabulary size, not
the batch, so a row's draw does not depend on what else is in the batch.

On by default (PAGEDLLM_FUSED_SAMPLER=0 turns it off): on an H100, trt-8b-2k ran 17,825
output tok/s with it against 16,885 without, in the same call (benchmarks/results/
2026-12-07-gpu-h100-trt-8b-2k-s{0,1}-7037f9f.json), and its GPU tests passed there. Rows
with top-k, top-p or min-p take the tensor-op path.
"""

from __future__ import annotations

import torch

from pagedllm.config import env_flag

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

SPLIT = 4096  # tokens a program of the first kernel reads (a multiple of BLOCK)
BLOCK = 1024


def enabled() -> bool:
    return env_flag("PAGEDLLM_FUSED_SAMPLER", default=True)


def usable(logits: torch.Tensor, top_k, top_p, min_p) -> bool:
    """Whether this batch's draw can go to the kernels: CUDA logits (2-D, unit stride along
    the vocabulary), no top-k / top-p / min-p cut, and the switch on."""
    return (triton is not None and enabled() and logits.is_cuda and logits.dim() == 2
            and logits.stride(-1) == 1 and top_k is None and top_p is None and min_p is None)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _split_sums_kernel(X, InvT, PartM, PartS, V, stride_x, NSPLIT,
                           SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, split): the split's maximum of x / T (log2 units) and its sum of
        2^(x / T - max), rescaled online block by block."""
        row = tl.program_id(0)
        j = tl.program_id(1)
        c = tl.load(InvT + row) * 1.4426950408889634
        base = X + row.to(tl.int64) * stride_x
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for off in range(0, SPLIT, BLOCK):
            idx = j * SPLIT + off + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * c
            new_m = tl.maximum(m, tl.max(x, 0))
            keep = tl.where(m == float("-inf"), 0.0, tl.exp2(m - new_m))
            w = tl.where(x == float("-inf"), 0.0, tl.exp2(x - new_m))
            s = s * keep + tl.sum(w, 0)
            m = new_m
        tl.store(PartM + row * NSPLIT + j, m)
        tl.store(PartS + row * NSPLIT + j, s)

    @triton.jit
    def _pick_kernel(X, InvT, PartM, PartS, U, Out, V, stride_x, NSPLIT,
                     SPLIT: tl.constexpr, BLOCK: tl.constexpr, NSPLIT_P2: tl.constexpr):
        """Program row: the split where the cumulative weight passes u * total, then the
        token inside it."""
        row = tl.program_id(0)
        js = tl.arange(0, NSPLIT_P2)
        valid = js < NSPLIT
        pm = tl.load(PartM + row * NSPLIT + js, mask=valid, other=float("-inf"))
        ps = tl.load(PartS + row * NSPLIT + js, mask=valid, other=0.0)
        big = tl.max(pm, 0)
        ws = tl.where(pm == float("-inf"), 0.0, ps * tl.exp2(pm - big))
        target = tl.load(U + row) * tl.sum(ws, 0)
        cum = tl.cumsum(ws, 0)
        first = tl.sum((valid & (cum <= target)).to(tl.int32), 0)  # splits wholly below it
        last_nz = tl.max(tl.where(ws > 0, js, -1), 0)
        jstar = tl.maximum(tl.minimum(first, last_nz), 0)
        rest = target - tl.sum(tl.where(js < jstar, ws, 0.0), 0)
        c = tl.load(InvT + row) * 1.4426950408889634
        base = X + row.to(tl.int64) * stride_x
        acc = tl.zeros((), tl.float32)
        found = tl.full((), -1, tl.int32)
        last = tl.full((), -1, tl.int32)
        for off in range(0, SPLIT, BLOCK):
            idx = jstar * SPLIT + off + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * c
            w = tl.where(x == float("-inf"), 0.0, tl.exp2(x - big))
            cs = tl.cumsum(w, 0) + acc
            below = tl.sum((cs <= rest).to(tl.int32), 0)
            hit = (found < 0) & (below < BLOCK)
            found = tl.where(hit, jstar * SPLIT + off + below, found)
            last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), 0))
            acc += tl.sum(w, 0)
        token = tl.where(found >= 0, found, last)
        token = tl.minimum(tl.maximum(token, 0), V - 1)
        tl.store(Out + row, token.to(tl.int64))


def draw(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row from softmax(logits / T) by inverse CDF at `u` (one uniform a row).
    Rows with T = 0 (greedy) are drawn at T = 1; the caller takes their argmax instead."""
    n, vocab = logits.shape
    inv_t = torch.where(temperature > 0, 1.0 / temperature.clamp(min=1e-30), torch.ones_like(temperature))
    inv_t = inv_t.to(torch.float32).contiguous()
    nsplit = triton.cdiv(vocab, SPLIT)
    part_m = torch.empty((n, nsplit), dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    _split_sums_kernel[(n, nsplit)](logits, inv_t, part_m, part_s, vocab, logits.stride(0), nsplit,
                                    SPLIT=SPLIT, BLOCK=BLOCK, num_warps=4)
    _pick_kernel[(n,)](logits, inv_t, part_m, part_s, u.to(torch.float32).contiguous(), out, vocab,
                       logits.stride(0), nsplit, SPLIT=SPLIT, BLOCK=BLOCK, NSPLIT_P2=_pow2(nsplit),
                       num_warps=4)
    return out
