"""Executors run the model for the engine: one ModelRunner in-process, or one worker per
tensor-parallel rank (local processes, or Ray actors). All present the ModelRunner surface
the engine uses, so the engine loop is the same for every one of them."""

from pagedllm.executor.base import Executor, ExecutorDeadError, make_executor

__all__ = ["Executor", "ExecutorDeadError", "make_executor"]
