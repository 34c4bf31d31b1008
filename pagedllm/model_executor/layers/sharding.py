"""How a tensor-parallel rank takes its block of a full checkpoint tensor.

Every sharded layer (the linear family, the vocabulary-parallel embedding and head) loads
itself from full-size checkpoint tensors: the rank cuts its rows or columns out before
copying to its device, so no device ever holds a whole sharded weight. A tensor handed in
may be a torch tensor or a lazy safetensors slice; then only this rank's bytes are read
from disk. `ShardedWeights` is the loader's side of that contract.
"""

from __future__ import annotations

import torch

from pagedllm.distributed import divide


def shape_of(t) -> tuple[int, ...]:
    """Shape of a torch tensor or of a lazy safetensors slice (which has no `.shape`)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def read_block(t, *index: slice) -> torch.Tensor:
    """`t[index]` (all of `t` when no index is given) as a tensor. For a lazy safetensors
    slice only that block is read from the file, which is how a rank avoids materialising
    a tensor it keeps one slice of; a torch tensor gives a view."""
    if index:
        return t[index]
    if isinstance(t, torch.Tensor):
        return t
    return t[()] if not t.get_shape() else t[:]  # a 0-dim slice takes no `:`


class _LazyRows:
    """Rows [start, stop) of a lazy safetensors slice, itself lazy: indexing reads only the
    block asked for (a fused checkpoint tensor cut into shards, each rank reading its part)."""

    def __init__(self, t, start: int, stop: int):
        self.t, self.start, self.stop = t, start, stop

    def get_shape(self) -> list[int]:
        return [self.stop - self.start, *self.t.get_shape()[1:]]

    def get_dtype(self) -> str:
        return self.t.get_dtype()

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        lo, hi, step = first.indices(self.stop - self.start)
        if step != 1:
            raise ValueError("a row block is read with unit steps only")
        return self.t[(slice(self.start + lo, self.start + hi), *index[1:])]


def rows(t, start: int, stop: int):
    """Rows [start, stop) of a torch tensor (a view) or of a lazy safetensors slice (still
    lazy), for the sharded layers to cut their block from."""
    return t[start:stop] if isinstance(t, torch.Tensor) else _LazyRows(t, start, stop)


def dtype_of(t) -> torch.dtype:
    """dtype of a torch tensor or of a lazy safetensors slice (read without its data)."""
    if isinstance(t, torch.Tensor):
        return t.dtype
    name = t.get_dtype()
    if name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unknown safetensors dtype {name!r}")
    return _SAFETENSORS_DTYPES[name]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def check_shape(what: str, tensor, expected: tuple[int, ...]) -> None:
    """The checkpoint tensor's full shape, checked before a slice of it is read (a slice
    of a wrong-sized tensor would otherwise load without error)."""
    if shape_of(tensor) != expected:
        raise ValueError(f"{what}: checkpoint shape {shape_of(tensor)} != expected {expected}")


def copy_block(what: str, target: torch.Tensor, block: torch.Tensor) -> None:
    """`target.copy_(block)` without copy_'s broadcasting: a block of the wrong shape is an
    error, not a silently repeated row."""
    if tuple(target.shape) != tuple(block.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(block.shape)} != expected {tuple(target.shape)}")
    target.copy_(block)


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


class ShardedWeights:
    """Mixin of the modules that load themselves: the model's loader hands them full
    checkpoint tensors by parameter name (and fused shard), they keep their rank's block
    and know which pieces are still missing. Parameters outside such modules (norms) are
    replicated and copied whole by the loader."""

    def load_shard(self, param_name: str, shard: str | None, tensor) -> None:
        raise NotImplementedError

    def missing(self) -> list[str]:
        """Checkpoint tensors not received yet, as `name` or `name#shard`."""
        raise NotImplementedError

    def finish_loading(self) -> None:
        """Called once every tensor is in: checks completeness and prepares the forward."""
        if missing := self.missing():
            raise ValueError(f"checkpoint is missing {missing}")
