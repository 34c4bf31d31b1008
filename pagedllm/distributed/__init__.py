"""Tensor-parallel process state and the collectives the parallel layers need."""

from pagedllm.distributed.parallel_state import (
    all_gather,
    all_reduce,
    broadcast_from_first,
    destroy_distributed,
    divide,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
)

__all__ = ["all_gather", "all_reduce", "broadcast_from_first", "destroy_distributed", "divide",
           "get_tp_rank", "get_tp_world_size", "init_distributed"]
