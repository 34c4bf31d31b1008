"""One tensor-parallel rank: joins the group, builds its ModelRunner, answers calls.

The same class runs in a spawned process (MultiprocExecutor) and as a Ray actor
(RayExecutor); only the transport around it differs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import traceback
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed import destroy_distributed, init_distributed
from pagedllm.model_source import ModelSource

logger = logging.getLogger(__name__)

# Methods a worker answers (a closed list: a message names one, nothing else is callable).
CALLS = ("info", "determine_num_blocks", "allocate_kv_cache", "capture_graphs", "execute")


def rank_device(config: EngineConfig, local_index: int) -> torch.device:
    """GPU `local_index` of those this process sees on CUDA (rank r on one host: GPU r; a
    Ray actor sees only its own GPU: 0); every rank uses the CPU otherwise."""
    dev = torch.device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", local_index)
    return dev


class Worker:
    def __init__(self, rank: int, world_size: int, init_method: str, config: EngineConfig,
                 source: ModelSource, hf_config, max_model_len: int, local_index: int | None = None):
        from pagedllm.worker.model_runner import ModelRunner

        self.rank = rank
        self.world_size = world_size
        device = rank_device(config, rank if local_index is None else local_index)
        if device.type == "cpu":  # ranks share the cores; oversubscription slows every step
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        init_distributed(rank, world_size, init_method, device)
        self.runner = ModelRunner(dataclasses.replace(config, device=str(device)), source, hf_config,
                                  max_model_len)

    def info(self) -> dict[str, Any]:
        r = self.runner
        return {"device": r.device, "dtype": r.dtype, "vocab_size": r.vocab_size,
                "weight_bytes": r.weight_bytes, "bytes_per_block": r.bytes_per_block,
                "page_spec": r.page_spec,
                "lora_targets": r.lora.targets() if r.lora is not None else []}

    def determine_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        return self.runner.determine_num_blocks(max_num_batched_tokens, max_num_seqs)

    def allocate_kv_cache(self, num_blocks: int, swap_blocks: int = 0) -> None:
        self.runner.allocate_kv_cache(num_blocks, swap_blocks)

    def capture_graphs(self, max_num_seqs: int) -> None:
        # A captured decode step would have to contain the NCCL all-reduces; until that
        # is measured and tested, TP ranks run decode eagerly.
        if self.world_size == 1:
            self.runner.capture_graphs(max_num_seqs)

    def execute(self, so):
        out = self.runner.execute(so)
        return out if self.rank == 0 else None  # rank 0 speaks for the group

    def call(self, method: str, args: tuple) -> Any:
        if method not in CALLS:
            raise ValueError(f"unknown worker call {method!r}")
        return getattr(self, method)(*args)

    def close(self) -> None:
        destroy_distributed()


def _exit_with_parent(parent_pid: int) -> None:
    """A worker whose engine vanished (killed with SIGKILL: no atexit ran) exits on its
    own within a second instead of holding a GPU forever. Covers the case of a worker
    blocked in a collective, where the closed pipe is never read."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, source: ModelSource,
                hf_config, max_model_len: int, conn, parent_pid: int) -> None:
    """Process entry point: build the Worker, then answer (method, args) messages until
    told to stop or until the engine's end of the pipe closes.

    Replies are ("ok", result) or ("error", text): a failure is reported, never raised out
    of the loop, so the engine always learns why a rank stopped."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        worker = Worker(rank, world_size, init_method, config, source, hf_config, max_model_len)
    except BaseException:
        conn.send(("error", f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        return
    conn.send(("ok", None))
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                return  # the engine is gone
            if method == "shutdown":
                return
            try:
                reply = ("ok", worker.call(method, args))
            except Exception:
                reply = ("error", f"rank {rank} {method} failed:\n{traceback.format_exc()}")
            conn.send(reply)
    finally:
        worker.close()
