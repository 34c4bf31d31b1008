"""Who this process is in the tensor-parallel group, and the three collectives TP needs.

Module state rather than an object handed down: the layers are built deep inside a model
constructor (by a registry, from a config), and threading a group through every model
signature would touch every architecture for one number. A process belongs to at most one
TP group, so a process-wide value is exact. At world size 1 nothing is initialised and
every collective returns its input untouched: single-device serving pays nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _State:
    rank: int = 0
    world_size: int = 1


_state = _State()


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the TP group: NCCL between GPUs, gloo between CPU processes.

    NVLink SHARP (NVLS) multicast stays off: it reserves GPU memory per communicator and
    is refused on the shared machines we run on; ring/tree all-reduce is what TP uses."""
    global _state
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                **({"device_id": device} if backend == "nccl" else {}))
    _state = _State(rank, world_size)


def destroy_distributed() -> None:
    global _state
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state = _State()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_world_size() -> int:
    return _state.world_size


def divide(total: int, parts: int, what: str) -> int:
    """`total / parts`, or a clear error naming what could not be split."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (row-parallel outputs, vocab-parallel embeddings)."""
    if _state.world_size > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim` in rank order (vocab-sharded logits)."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_from_first(values: list[int], device: torch.device) -> list[int]:
    """Rank 0's list of ints on every rank (same length everywhere).

    Sampled tokens go through this: every rank samples from the same gathered logits with
    the same generator state, so they agree in principle, but a single disagreement (a
    floating-point tie resolved differently) would silently desynchronise the ranks' token
    histories and KV caches. One tiny broadcast per step makes agreement a fact."""
    if _state.world_size == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.long, device=device)
    dist.broadcast(t, src=0)
    return t.tolist()
