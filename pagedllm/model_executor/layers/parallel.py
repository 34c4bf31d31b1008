"""Vocabulary-parallel layers: the embedding and the float LM head, split by vocabulary rows.

The vocabulary is the largest matrix of small models and replicating it would waste most
of tensor parallelism's saving, so each rank keeps a contiguous slice of its rows (padded
to a multiple of the world size). The decoder's linear layers are split the Megatron way
instead (layers/linear.py). At world size 1 both are exactly nn.Embedding / F.linear, so a
model has one code path; each loads its own slice (layers/sharding.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import batch_invariant
from pagedllm.distributed import all_gather, all_reduce, get_tp_rank, get_tp_world_size
from pagedllm.model_executor.layers.sharding import ShardedWeights, read_block, shape_of


class VocabParallelEmbedding(ShardedWeights, nn.Module):
    """Vocabulary rows split over ranks (padded to a multiple of the world size; padding
    rows are zero). A rank looks up the ids it owns, zeroes the rest, and the all-reduce
    sums the one non-zero row per token: the same result as the full table."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        rank, world = get_tp_rank(), get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // world)
        self.start = rank * self.per_rank
        self.num_real = max(0, min(num_embeddings - self.start, self.per_rank))  # rows not padding
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        self._loaded: set[str] = set()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(x)

    def load_shard(self, param_name: str, shard: None, tensor) -> None:
        """This rank's vocabulary rows of `weight` (or of the head's `bias`); padding rows zero."""
        p = getattr(self, param_name, None) if param_name in ("weight", "bias") else None
        if not isinstance(p, nn.Parameter):
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in a vocabulary-parallel layer")
        full = (self.num_embeddings, *p.shape[1:])
        if shape_of(tensor) != full:
            raise ValueError(f"checkpoint shape {shape_of(tensor)} != {full}")
        p.data[: self.num_real].copy_(read_block(tensor, slice(self.start, self.start + self.num_real)))
        p.data[self.num_real :].zero_()
        self._loaded.add(param_name)

    def missing(self) -> list[str]:
        return [name for name, _ in self.named_parameters(recurse=False) if name not in self._loaded]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (so a tied head
    is the embedding's own slice). Each rank computes logits of its rows; they are
    gathered so that every rank holds the full logits and the sampler sees one vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        self.bias = nn.Parameter(torch.empty(self.per_rank)) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(batch_invariant.linear(hidden, self.weight, self.bias), self.num_embeddings)


def gather_logits(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """Full-vocabulary logits from every rank's slice, padding columns dropped."""
    if get_tp_world_size() == 1:
        return local
    return all_gather(local, dim=-1)[..., :vocab]
