"""Tensor parallelism over a Ray cluster: the same Worker as MultiprocExecutor, placed as
Ray actors (one GPU each on CUDA), so ranks may sit on several hosts.

Rank 0's actor hosts the torch.distributed rendezvous (its node's address and a free port
there), because the engine's own host may not be reachable from the others or may hold no
rank at all. A dead actor surfaces as RayActorError from its pending call; the executor
then kills the rest and raises ExecutorDeadError, like the local executor.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.base import ExecutorDeadError, RankGroupExecutor
from pagedllm.executor.worker import Worker
from pagedllm.model_source import ModelSource

logger = logging.getLogger(__name__)


class RayWorker:
    """Actor shell: created empty (cheap, so rank 0 can be asked for an address first),
    then `start` builds the Worker."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def address(self) -> str:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def pid(self) -> int:
        import os

        return os.getpid()

    def start(self, rank: int, world_size: int, init_method: str, config: EngineConfig,
              source: ModelSource, hf_config, max_model_len: int) -> None:
        self.worker = Worker(rank, world_size, init_method, config, source, hf_config, max_model_len,
                             local_index=0)  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU

    def call(self, method: str, args: tuple) -> Any:
        assert self.worker is not None
        return self.worker.call(method, args)


def _kill_actors(actors: list) -> None:
    import ray

    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # already gone, or Ray itself is shutting down
            pass


class RayExecutor(RankGroupExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, max_model_len: int):
        import ray

        if not ray.is_initialized():
            ray.init(address="auto")  # join the running cluster (`ray start --head` on the head node)
        self.world_size = world = config.tensor_parallel_size
        cuda = config.device.startswith("cuda")
        opts = {"num_gpus": 1, "num_cpus": 0} if cuda else {"num_cpus": 1}
        actor_cls = ray.remote(**opts)(RayWorker)
        self._dead: str | None = None
        self._actors = [actor_cls.remote() for _ in range(world)]
        self._finalizer = weakref.finalize(self, _kill_actors, self._actors)
        try:
            init_method = ray.get(self._actors[0].address.remote())
            self._wait([a.start.remote(rank, world, init_method, config, source, hf_config, max_model_len)
                        for rank, a in enumerate(self._actors)])
            self.worker_pids = ray.get([a.pid.remote() for a in self._actors])
            info = self._run("info", ())[0]
        except BaseException:
            self.shutdown()
            raise
        self._adopt(info)

    def _run(self, method: str, args: tuple) -> list[Any]:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        import ray

        ref = ray.put(args)  # serialised once, read by every actor
        return self._wait([a.call.remote(method, ref) for a in self._actors])

    def _wait(self, refs: list) -> list[Any]:
        """Results in rank order; the first dead actor ends the group (waiting on all at
        once with ray.get could block on a rank stuck in a collective with the dead one)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        results: list[Any] = [None] * len(refs)
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = index[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as e:
                self._dead = f"tensor-parallel Ray worker rank {rank} died: {e}"
            except RayTaskError as e:
                self._dead = f"tensor-parallel Ray worker rank {rank} failed: {e}"
            if self._dead is not None:
                logger.error("stopping tensor-parallel workers: %s", self._dead)
                self.shutdown()
                raise ExecutorDeadError(self._dead)
        return results
