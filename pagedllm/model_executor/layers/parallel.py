"""Tensor-parallel layers: each rank holds a slice of a weight and computes its part.

The Megatron split, chosen so that one decoder layer needs two all-reduces and nothing
else: q/k/v and gate/up are column-parallel (each rank computes its own heads and its
own slice of the intermediate activations, with no communication), o_proj and down_proj
are row-parallel (each rank multiplies its input slice; the partial sums are all-reduced).
The embedding and the LM head are split by vocabulary rows, because the vocabulary is the
largest matrix of small models and replicating it would waste most of the saving.

Every layer also works at world size 1, where it is exactly nn.Linear / nn.Embedding, so
a model has one code path. Each layer loads its own slice from a full checkpoint tensor
(`load_shard`): the rank cuts its rows or columns out before copying to its device, so no
device ever holds the full weight. The tensor handed in may be a torch tensor or a lazy
safetensors slice (then only this rank's bytes are read from disk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import all_gather, all_reduce, divide, get_tp_rank, get_tp_world_size


def shape_of(t) -> tuple[int, ...]:
    """Shape of a torch tensor or of a lazy safetensors slice (which has no `.shape`)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def read_block(t, *index: slice) -> torch.Tensor:
    """`t[index]` (all of `t` when no index is given) as a tensor. For a lazy safetensors
    slice only that block is read from the file, which is how a rank avoids materialising
    a tensor it keeps one slice of; a torch tensor gives a view."""
    if index:
        return t[index]
    return t if isinstance(t, torch.Tensor) else t[:]


def _narrow(t, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length) of a tensor or of a lazy
    safetensors slice; the full-size case is passed through without a copy."""
    if isinstance(t, torch.Tensor):
        return t if (start == 0 and length == t.shape[dim]) else t.narrow(dim, start, length)
    index = (slice(start, start + length),) if dim == 0 else (slice(None), slice(start, start + length))
    return t[index]


def head_partition(num_heads: int, rank: int, world: int, what: str,
                   replicate: bool = False) -> tuple[int, int]:
    """(first head, number of heads) this rank computes.

    With fewer KV heads than ranks (GQA, e.g. 2 KV heads on 4 ranks; `replicate`) a KV
    head cannot be split, so each is replicated on `world / num_heads` consecutive ranks:
    rank r keeps head r * num_heads // world, which is the KV head its own query heads
    attend with. Query heads are never replicated (o_proj sums over them)."""
    if num_heads >= world or not replicate:
        n = divide(num_heads, world, what)
        return rank * n, n
    if world % num_heads:
        raise ValueError(f"{what} ({num_heads}) must divide tensor_parallel_size ({world}) "
                         "when it is smaller")
    return rank * num_heads // world, 1


class ColumnParallelLinear(nn.Linear):
    """Output rows split over ranks; several checkpoint tensors may be fused into one
    matmul (q|k|v, gate|up), each split on its own so every rank's slice stays fused.

    `parts` maps a shard name (None: an unfused layer) to (rows in the checkpoint tensor,
    first row this rank keeps, rows this rank keeps)."""

    def __init__(self, in_features: int, parts: dict[str | None, tuple[int, int, int]], bias: bool):
        super().__init__(in_features, sum(n for _, _, n in parts.values()), bias=bias)
        self.parts = parts
        self.shards: dict[str | None, tuple[int, int]] = {}  # name -> (local start, rows)
        start = 0
        for name, (_, _, n) in parts.items():
            self.shards[name] = (start, n)
            start += n

    @classmethod
    def split_evenly(cls, in_features: int, sizes: dict[str | None, int], bias: bool) -> ColumnParallelLinear:
        """Each part split into equal contiguous slices (gate/up, an unfused layer)."""
        rank, world = get_tp_rank(), get_tp_world_size()
        parts = {}
        for name, size in sizes.items():
            n = divide(size, world, f"output size of {name or 'the layer'}")
            parts[name] = (size, rank * n, n)
        return cls(in_features, parts, bias)

    @classmethod
    def qkv(cls, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool) -> ColumnParallelLinear:
        """Fused q/k/v split by heads: each rank gets its query heads and the KV heads
        they attend with (replicated when there are fewer KV heads than ranks)."""
        rank, world = get_tp_rank(), get_tp_world_size()
        q0, nq = head_partition(num_heads, rank, world, "num_attention_heads")
        k0, nk = head_partition(num_kv_heads, rank, world, "num_key_value_heads", replicate=True)
        kv = (num_kv_heads * head_dim, k0 * head_dim, nk * head_dim)
        return cls(hidden, {"q": (num_heads * head_dim, q0 * head_dim, nq * head_dim), "k": kv, "v": kv}, bias)

    def load_shard(self, param_name: str, shard: str | None, tensor) -> None:
        full, src, n = self.parts[shard]
        if shape_of(tensor)[0] != full:
            raise ValueError(f"shard {shard!r} expects {full} rows, checkpoint has {shape_of(tensor)[0]}")
        start, _ = self.shards[shard]
        getattr(self, param_name).data[start : start + n].copy_(_narrow(tensor, 0, src, n))


class RowParallelLinear(nn.Linear):
    """Input columns split over ranks (the input is already split: the previous layer
    was column-parallel); partial products are summed with one all-reduce, and the bias
    is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        world = get_tp_world_size()
        local = divide(in_features, world, "input size of a row-parallel layer")
        super().__init__(local, out_features, bias=bias)
        self.full_in = in_features
        self.in_start = get_tp_rank() * local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_world_size() == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load_shard(self, param_name: str, shard: None, tensor) -> None:
        p = getattr(self, param_name)
        if param_name == "bias":
            p.data.copy_(read_block(tensor))
            return
        if shape_of(tensor) != (self.out_features, self.full_in):
            raise ValueError(f"checkpoint shape {shape_of(tensor)} != {(self.out_features, self.full_in)}")
        p.data.copy_(_narrow(tensor, 1, self.in_start, self.in_features))


class VocabParallelEmbedding(nn.Module):
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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(x)

    def load_shard(self, param_name: str, shard: None, tensor) -> None:
        shape = shape_of(tensor)
        if shape != (self.num_embeddings, self.weight.shape[1]):
            raise ValueError(f"checkpoint shape {shape} != {(self.num_embeddings, self.weight.shape[1])}")
        self.weight.data[: self.num_real].copy_(_narrow(tensor, 0, self.start, self.num_real))
        self.weight.data[self.num_real :].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary rows like the embedding (so a tied head
    is the embedding's own slice). Each rank computes logits of its rows; they are
    gathered so that every rank holds the full logits and the sampler sees one vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        self.bias = nn.Parameter(torch.empty(self.per_rank)) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(F.linear(hidden, self.weight, self.bias), self.num_embeddings)

    def load_shard(self, param_name: str, shard: None, tensor) -> None:
        if param_name == "weight":
            super().load_shard(param_name, shard, tensor)
            return
        assert self.bias is not None
        self.bias.data[: self.num_real].copy_(_narrow(tensor, 0, self.start, self.num_real))
        self.bias.data[self.num_real :].zero_()


def gather_logits(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """Full-vocabulary logits from every rank's slice, padding columns dropped."""
    if get_tp_world_size() == 1:
        return local
    return all_gather(local, dim=-1)[..., :vocab]
