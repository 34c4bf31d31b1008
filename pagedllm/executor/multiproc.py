"""Tensor parallelism on one host: one spawned process per rank, driven over pipes.

Each step the engine pickles the SchedulerOutput once and writes the same bytes to every
rank's pipe; every rank runs the step (the collectives inside the layers keep them in
lock step) and answers; rank 0's answer carries the RunnerOutput, the others a bare ack.
The acks cost a few bytes and are what lets the engine notice a rank that failed.

Failure is made loud and bounded rather than hung:
- while waiting the engine also waits on every process's sentinel, so a dead worker
  (killed, OOM, segfault) is seen at once, the others are stopped and the step raises
  ExecutorDeadError; every later call raises it too;
- if every rank reports the same step failure, the ranks are still in step: the error is
  raised as an ordinary exception and the engine fails just that step's requests;
- if only some ranks fail, the rest wait in a collective that will never complete: after
  a grace period the group is declared dead.
Workers are daemonic, stopped by `shutdown()` or by a finalizer at exit, and each exits
by itself if the engine process disappears (see worker._exit_with_parent).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from pagedllm.config import EngineConfig
from pagedllm.executor.base import ExecutorDeadError, RankGroupExecutor
from pagedllm.executor.worker import worker_main
from pagedllm.model_source import ModelSource

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large checkpoint from a slow disk takes minutes
MISMATCH_GRACE_S = 10.0  # how long the other ranks may still answer after one rank failed


def _stop_workers(procs: list, conns: list[Connection], tmpdir: str, grace_s: float = 5.0) -> None:
    """Ask politely, then terminate, then kill: no worker outlives the engine."""
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
    for conn in conns:
        conn.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


class MultiprocExecutor(RankGroupExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, max_model_len: int):
        self.world_size = world = config.tensor_parallel_size
        ctx = mp.get_context("spawn")  # fork would copy the engine's threads and CUDA state
        tmpdir = tempfile.mkdtemp(prefix="pagedllm-tp-")
        init_method = f"file://{os.path.join(tmpdir, 'rendezvous')}"  # no port to race for
        self._procs: list = []
        self._conns: list[Connection] = []
        self._dead: str | None = None
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"pagedllm-tp{rank}", daemon=True,
                            args=(rank, world, init_method, config, source, hf_config, max_model_len,
                                  theirs, os.getpid()))
            p.start()
            theirs.close()
            self._procs.append(p)
            self._conns.append(ours)
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns, tmpdir)
        try:
            self._collect(timeout=START_TIMEOUT_S)
            info = self._run("info", ())[0]
        except BaseException:
            self.shutdown()
            raise
        self._adopt(info)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------------ transport
    def _run(self, method: str, args: tuple) -> list[Any]:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)  # once for all ranks
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._die(f"tensor-parallel worker rank {rank} is gone ({self._exit_text(rank)})")
        return self._collect()

    def _exit_text(self, rank: int) -> str:
        p = self._procs[rank]
        p.join(timeout=0.5)
        return f"pid {p.pid}, exit code {p.exitcode}"

    def _die(self, reason: str) -> None:
        self._dead = reason
        logger.error("stopping tensor-parallel workers: %s", reason)
        self.shutdown()
        raise ExecutorDeadError(reason)

    def _collect(self, timeout: float | None = None) -> list[Any]:
        """Every rank's answer, watching the processes while waiting."""
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            ready = wait(list(pending.values()) + list(sentinels), timeout=left)
            if not ready:
                silent = sorted(pending)
                if errors:
                    first = min(errors)
                    self._die(f"tensor-parallel ranks out of step: rank {first} failed while "
                              f"ranks {silent} did not answer:\n{errors[first]}")
                self._die(f"tensor-parallel ranks {silent} did not answer within {timeout:.0f}s")
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    why = f"tensor-parallel worker rank {rank} died ({self._exit_text(rank)})"
                    conn = pending.get(rank)
                    if conn is not None and conn.poll():  # its last words, e.g. a start failure
                        try:
                            why += f":\n{conn.recv()[1]}"
                        except (EOFError, OSError):
                            pass
                    self._die(why)
                rank = next(r for r, c in pending.items() if c is obj)
                try:
                    status, value = obj.recv()
                except (EOFError, OSError):
                    self._die(f"tensor-parallel worker rank {rank} died ({self._exit_text(rank)})")
                del pending[rank]
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
            if errors and pending:
                grace = time.monotonic() + MISMATCH_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
        if len(errors) == self.world_size:  # the same failure everywhere: still in step
            raise RuntimeError(errors[0])
        if errors:
            first = min(errors)
            self._die(f"tensor-parallel ranks out of step: only ranks {sorted(errors)} failed:\n{errors[first]}")
        return results
