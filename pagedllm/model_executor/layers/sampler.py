"""Sampling for a mixed batch: every row has its own settings, all applied as tensor ops.

Order (vLLM's): logit bias and min-token masking, penalties, then greedy rows take the
argmax; the others are divided by temperature, cut by top-k / top-p / min-p and drawn by
inverse CDF with one uniform per row. A seeded row draws its uniform from its own
generator: that is what makes a seeded request's output independent of whatever else
shares the batch.

Reported logprobs are those of the raw model distribution (before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32, 0 for greedy rows
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where disabled
    top_p: torch.Tensor | None = None  # [N]
    min_p: torch.Tensor | None = None  # [N]
    generators: list[torch.Generator | None] = field(default_factory=list)
    # Penalties (None when no row uses them).
    presence: torch.Tensor | None = None  # [N]
    frequency: torch.Tensor | None = None  # [N]
    repetition: torch.Tensor | None = None  # [N]
    output_counts: torch.Tensor | None = None  # [N, V] occurrences in the output so far
    seen_mask: torch.Tensor | None = None  # [N, V] token in prompt or output
    # Sparse additive biases: flat (row, token, value) triples; -inf masks use the same path.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    all_greedy: bool = False


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row with logprobs requested: (token ids, logprobs, ranks); first entry is the
    # sampled token, then the top-k in order.
    logprobs: list[tuple[list[int], list[float], list[int]] | None]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.repetition is not None and b.seen_mask is not None:
        rp = b.repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(b.seen_mask, penalised, logits)
    if b.output_counts is not None:
        logits = logits - b.frequency[:, None] * b.output_counts
        logits = logits - b.presence[:, None] * (b.output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.min_p is not None:
        probs = logits.softmax(-1)
        thresh = probs.max(-1, keepdim=True).values * b.min_p[:, None]
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if b.top_k is None and b.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        mask |= ranks >= b.top_k[:, None]
    if b.top_p is not None:
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above this token
        mask |= before > b.top_p[:, None]
    mask[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _uniforms(n: int, generators: list[torch.Generator | None], default: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """One uniform per row; a seeded row draws from its own generator."""
    u = torch.rand(n, generator=default, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, device=device)[0]
    return u


class Sampler:
    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        want_lp = any(k is not None for k in b.num_logprobs)
        raw_logprobs = logits.log_softmax(-1) if want_lp else None

        if b.bias_rows is not None:
            logits = logits.index_put((b.bias_rows, b.bias_tokens), b.bias_values, accumulate=True)
        logits = apply_penalties(logits, b)

        if b.all_greedy:
            sampled = logits.argmax(-1)
        else:
            greedy = b.temperature == 0
            temp = torch.where(greedy, torch.ones_like(b.temperature), b.temperature)
            scaled = apply_top_k_top_p_min_p(logits / temp[:, None], b)
            # Inverse-CDF draw: one uniform per row (a full-vocabulary noise tensor per
            # step costs more than the softmax itself on CPU).
            cdf = scaled.softmax(-1).cumsum_(-1)
            u = _uniforms(len(cdf), b.generators, self.generator, cdf.device) * cdf[:, -1]
            # right=True: token i wins for cdf[i-1] <= u < cdf[i], never a zero-probability one.
            drawn = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
            sampled = torch.where(greedy, logits.argmax(-1), drawn)

        token_ids = sampled.tolist()
        out_lp: list = [None] * len(token_ids)
        if want_lp:
            k = max(n or 0 for n in b.num_logprobs)
            sel = raw_logprobs.gather(-1, sampled[:, None])
            ranks = (raw_logprobs > sel).sum(-1) + 1
            top_v, top_i = raw_logprobs.topk(k, dim=-1) if k else (None, None)
            sel_l, ranks_l = sel.squeeze(-1).tolist(), ranks.tolist()
            top_vl = top_v.tolist() if k else None
            top_il = top_i.tolist() if k else None
            for r, n in enumerate(b.num_logprobs):
                if n is None:
                    continue
                ids = [token_ids[r]] + (top_il[r][:n] if n else [])
                lps = [sel_l[r]] + (top_vl[r][:n] if n else [])
                rks = [ranks_l[r]] + list(range(1, n + 1))
                out_lp[r] = (ids, lps, rks)
        return SamplerOutput(token_ids, out_lp)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Logprob and rank of each target token under the raw distribution, plus the top k."""
    lp = logits.float().log_softmax(-1)
    sel = lp.gather(-1, targets[:, None])
    ranks = ((lp > sel).sum(-1) + 1).tolist()
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    out = []
    for r, t in enumerate(targets.tolist()):
        ids = [t] + (top_i[r].tolist() if k else [])
        lps = [sel[r, 0].item()] + (top_v[r].tolist() if k else [])
        rks = [ranks[r]] + list(range(1, k + 1))
        out.append((ids, lps, rks))
    return out
