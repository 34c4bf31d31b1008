"""Executors run the model for the engine: one ModelRunner in-process, or one worker per
tensor-parallel rank (local processes, or Ray actors). All present the ModelRunner surface
the engine uses, so the engine loop is the same for every one of them.

The choice among them lives here rather than in base.py, which every executor imports: so
base stays the package's leaf, and only the executor chosen is imported (Ray's only when
asked for)."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor, ExecutorDeadError
from pagedllm.model_source import ModelSource

__all__ = ["Executor", "ExecutorDeadError", "make_executor"]


def make_executor(config: EngineConfig, source: ModelSource, hf_config, max_model_len: int) -> Executor:
    """In-process for one device; worker processes (or Ray actors) for tensor parallelism."""
    backend = config.distributed_executor_backend
    if config.tensor_parallel_size == 1 and backend is None:
        from pagedllm.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config, source, hf_config, max_model_len)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config, source, hf_config, max_model_len)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source, hf_config, max_model_len)
