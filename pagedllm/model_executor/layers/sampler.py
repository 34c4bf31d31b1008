"""Sampling for a mixed batch: every row has its own settings, all applied as tensor ops.

Order (vLLM's): a grammar's token mask (constrained decoding), logit bias and min-token
masking, penalties, then greedy rows take the argmax; the others are divided by temperature, cut by top-k / top-p / min-p and drawn by
inverse CDF with one uniform per row. A seeded row draws its uniform from its own
generator, and every step of the procedure is a per-row operation whose result for a row
does not depend on the settings of the others (a setting a row does not use is an exact
no-op on it): that is what makes a seeded request's output independent of whatever else
shares the batch (given the same logits; `batch_invariant` makes the logits so too).

Reported logprobs are those of the raw model distribution (before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedllm.model_executor.layers import sampler_kernels


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
    any_greedy: bool = True  # False: no row takes the argmax (the runner knows; unknown: True)
    # Constrained decoding: [N, ceil(V / 32)] int32 token bitmask (bit 0 = forbidden) and
    # the rows it applies to; None when no row of the batch is constrained.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None  # None: every row


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row with logprobs requested: (token ids, logprobs, ranks); first entry is the
    # sampled token, then the top-k in order.
    logprobs: list[tuple[list[int], list[float], list[int]] | None]


@dataclass
class SampledTensors:
    """What a step sampled, still on the device: reading it is the step's only host sync,
    so the engine can schedule and launch the next step before doing so."""

    token_ids: torch.Tensor  # [N] int64
    num_logprobs: list[int | None]
    sel: torch.Tensor | None = None  # [N] logprob of the sampled token
    ranks: torch.Tensor | None = None  # [N]
    top_v: torch.Tensor | None = None  # [N, k]
    top_i: torch.Tensor | None = None  # [N, k]
    accepted: torch.Tensor | None = None  # [N] bool, speculative verification only

    def to(self, device: torch.device, non_blocking: bool = False) -> SampledTensors:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return SampledTensors(move(self.token_ids), self.num_logprobs, move(self.sel),
                              move(self.ranks), move(self.top_v), move(self.top_i),
                              move(self.accepted))

    def to_output(self, token_ids: list[int] | None = None) -> SamplerOutput:
        """Python lists (after the device-to-host copy has completed)."""
        token_ids = self.token_ids.tolist() if token_ids is None else token_ids
        out_lp: list = [None] * len(token_ids)
        if self.sel is not None:
            sel_l, ranks_l = self.sel.tolist(), self.ranks.tolist()
            top_vl = self.top_v.tolist() if self.top_v is not None else None
            top_il = self.top_i.tolist() if self.top_i is not None else None
            for r, n in enumerate(self.num_logprobs):
                if n is None:
                    continue
                ids = [token_ids[r]] + (top_il[r][:n] if n else [])
                lps = [sel_l[r]] + (top_vl[r][:n] if n else [])
                rks = [ranks_l[r]] + list(range(1, n + 1))
                out_lp[r] = (ids, lps, rks)
        return SamplerOutput(token_ids, out_lp)


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
        # Rows without top-p (1.0, there because a neighbour has one) are left alone: a
        # float32 cumsum over a large vocabulary ends above 1.0, which would cut their tail.
        mask |= (before > b.top_p[:, None]) & (b.top_p < 1.0)[:, None]
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
        return self.sample(logits, b).to_output()

    def sample(self, logits: torch.Tensor, b: SamplingBatch,
               valid: torch.Tensor | None = None) -> SampledTensors:
        """Sample on the device without synchronising. Rows where `valid` is False (their
        logits were not finite) get token 0, so that no garbage id reaches an embedding."""
        raw_logprobs, logits = self._process(logits, b)

        if b.all_greedy:
            sampled = logits.argmax(-1)
        elif not b.any_greedy:
            sampled = self._drawn(logits, b)
        else:
            greedy = b.temperature == 0
            sampled = torch.where(greedy, logits.argmax(-1), self._drawn(logits, b))
        return self._output(sampled, valid, raw_logprobs, b)

    def verify(self, logits: torch.Tensor, b: SamplingBatch, draft: torch.Tensor,
               valid: torch.Tensor | None = None) -> SampledTensors:
        """Speculative decoding's check of proposed tokens, one row per position.

        `draft[r]` is the token proposed for the position after row r (-1: none, the
        last row of a request). Each row draws its token from the target distribution p
        exactly as `sample` would (greedy rows: the argmax), and its draft is accepted
        when the two agree; the caller keeps a request's tokens up to and including the
        first disagreement. Every emitted token is then a draw from p given the tokens
        before it, so the output follows the target distribution; for a deterministic
        draft (n-gram, a draft model's greedy choice) a draft is accepted with
        probability p(draft), as in rejection sampling, which is the most any
        distribution-keeping check can accept. Drawing with one uniform per row, in
        position order, keeps a seeded request's stream the same with or without
        speculation (the runner rewinds the draws of rows past the first disagreement).
        `accepted` marks the rows whose draft was taken."""
        raw_logprobs, logits = self._process(logits, b)
        has = draft >= 0
        x = draft.clamp(min=0)[:, None]
        best = logits.argmax(-1)
        if b.all_greedy:
            final = best
        else:
            greedy = b.temperature == 0
            final = torch.where(greedy, best, self._drawn(logits, b))
        accepted = has & (final == x[:, 0])
        sampled = final
        out = self._output(sampled, valid, raw_logprobs, b)
        out.accepted = accepted
        return out

    def _process(self, logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The raw logprobs (when any row reports logprobs) and the logits after the
        grammar mask, biases and penalties, before temperature.

        With none of those, and the draw going to the fused kernels (or every row greedy),
        the logits stay in the model's dtype: the argmax of the same values is the same
        token, and the kernels read them in float32 themselves; the float copy (a write
        and a read of rows x vocabulary floats, 0.2 ms a step at 512 rows of 128k on an
        H100) is skipped."""
        want_lp = any(k is not None for k in b.num_logprobs)
        if (not want_lp and b.grammar_bitmask is None and b.bias_rows is None and b.output_counts is None
                and b.seen_mask is None
                and (b.all_greedy or sampler_kernels.usable(logits, b.top_k, b.top_p, b.min_p))):
            return None, logits
        given, logits = logits, logits.float()
        raw_logprobs = logits.log_softmax(-1) if want_lp else None
        if b.grammar_bitmask is not None:
            from pagedllm.structured_output.bitmask import apply_bitmask

            masked = logits.clone() if logits is given else logits
            apply_bitmask(masked, b.grammar_bitmask, b.grammar_rows)  # the caller's stays whole
            logits = masked
        if b.bias_rows is not None:
            logits = logits.index_put((b.bias_rows, b.bias_tokens), b.bias_values, accumulate=True)
        return raw_logprobs, apply_penalties(logits, b)

    def _drawn(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """Every row's draw from its distribution (temperature, then top-k/top-p/min-p),
        one uniform a row; the caller keeps the argmax for greedy rows. Through the fused
        kernels (sampler_kernels) where they apply, else tensor ops."""
        u = _uniforms(len(logits), b.generators, self.generator, logits.device)
        if sampler_kernels.usable(logits, b.top_k, b.top_p, b.min_p):
            return sampler_kernels.draw(logits, b.temperature, u)
        return _draw(self._probs(logits, b), u)

    @staticmethod
    def _probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """The distribution a sampled row draws from: temperature, then top-k/top-p/min-p."""
        greedy = b.temperature == 0
        temp = torch.where(greedy, torch.ones_like(b.temperature), b.temperature)
        return apply_top_k_top_p_min_p(logits / temp[:, None], b).softmax(-1)

    @staticmethod
    def _output(sampled: torch.Tensor, valid: torch.Tensor | None, raw_logprobs: torch.Tensor | None,
                b: SamplingBatch) -> SampledTensors:
        if valid is not None:
            sampled = torch.where(valid, sampled, torch.zeros_like(sampled))
        out = SampledTensors(sampled, b.num_logprobs)
        if raw_logprobs is not None:
            k = max(n or 0 for n in b.num_logprobs)
            sel = raw_logprobs.gather(-1, sampled[:, None])
            out.sel = sel.squeeze(-1)
            out.ranks = (raw_logprobs > sel).sum(-1) + 1
            if k:
                out.top_v, out.top_i = raw_logprobs.topk(k, dim=-1)
        return out


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw, one uniform per row (a full-vocabulary noise tensor per step costs
    more than the softmax itself on CPU). The weights need not sum to one."""
    cdf = probs.cumsum(-1)
    u = u * cdf[:, -1]
    # right=True: token i wins for cdf[i-1] <= u < cdf[i], never a zero-probability one.
    return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)


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
