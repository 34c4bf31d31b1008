"""DeepSeek's expert routing: scores, optional group-limited choice, top-k, scaling.

Written in plain torch ops with fixed shapes and no host synchronisation, so the same code
runs eagerly, on CPU, and inside CUDA graphs. The expert computation that follows is the
shared MoE layer's (models/moe.py, layers/fused_moe.py).

- DeepSeek-V2 (`scoring_func` softmax): softmax over the router logits; `greedy` takes the
  top k, `group_limited_greedy` first keeps the `topk_group` groups (of `n_group`) with the
  highest single score and zeroes the rest. The weights are the chosen probabilities times
  `routed_scaling_factor`, or, with `norm_topk_prob` and k > 1, renormalised to sum to one
  instead (DeepSeek's released modelling code; transformers' port ignores the flag, and
  the released V2 checkpoints leave it off).
- DeepSeek-V3 (`noaux_tc`, sigmoid): the choice is made on sigmoid scores plus the
  learned `e_score_correction_bias`, within the `topk_group` groups whose two best biased
  scores sum highest; the weights are the unbiased sigmoid scores of the chosen experts,
  renormalised when `norm_topk_prob`, then times `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingSpec:
    top_k: int
    method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_config(cls, config, num_experts: int) -> RoutingSpec:
        scoring = getattr(config, "scoring_func", None)
        method = getattr(config, "topk_method", None)
        if getattr(config, "model_type", "") == "deepseek_v3" or method == "noaux_tc":
            if scoring not in (None, "sigmoid"):
                raise ValueError(f"noaux_tc routing scores with sigmoid, config says {scoring!r}")
            method = "noaux_tc"
        else:
            method = method or "greedy"
            if scoring not in (None, "softmax"):
                raise ValueError(f"unsupported scoring_func {scoring!r} for {method} routing")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"unsupported topk_method {method!r}")
        n_group = int(getattr(config, "n_group", None) or 1)
        topk_group = int(getattr(config, "topk_group", None) or n_group)
        if method != "greedy" and (num_experts % n_group or not 1 <= topk_group <= n_group):
            raise ValueError(f"{num_experts} experts cannot form {n_group} groups keeping {topk_group}")
        return cls(int(config.num_experts_per_tok), method, n_group, topk_group,
                   bool(getattr(config, "norm_topk_prob", False)),
                   float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))


def _group_mask(choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, E] bool: the experts in each token's `topk_group` best groups."""
    tokens, n_group = group_scores.shape
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return keep.unsqueeze(-1).expand(tokens, n_group, choice.shape[-1] // n_group).reshape(choice.shape)


def route(logits: torch.Tensor, spec: RoutingSpec,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int64 expert ids [T, k]) from float32 router logits [T, E]."""
    tokens, experts = logits.shape
    if spec.method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if spec.n_group > 1:
            grouped = choice.view(tokens, spec.n_group, experts // spec.n_group)
            best2 = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            choice = choice.masked_fill(~_group_mask(choice, best2, spec.topk_group), float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * spec.routed_scaling_factor, ids
    scores = logits.softmax(dim=-1)
    if spec.method == "group_limited_greedy" and spec.n_group > 1:
        best = scores.view(tokens, spec.n_group, experts // spec.n_group).amax(-1)
        scores = scores.masked_fill(~_group_mask(scores, best, spec.topk_group), 0.0)
    weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.norm_topk_prob and spec.top_k > 1:
        return weights / (weights.sum(-1, keepdim=True) + 1e-20), ids
    return weights * spec.routed_scaling_factor, ids
