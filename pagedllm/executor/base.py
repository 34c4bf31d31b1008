"""The surface the engine drives, and what the executors share.

The executors import this module, so it imports none of them: the choice of executor is
`pagedllm.executor.make_executor`."""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.page_spec import PageSpec
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.worker.model_runner import RunnerOutput


class ExecutorDeadError(RuntimeError):
    """A worker died or the ranks fell out of step: no further step can run. The engine
    must fail every request rather than retry (retrying would hang on a dead peer)."""


class Executor(Protocol):
    """What LLMEngine calls. Sizes are per device (per rank under tensor parallelism)."""

    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    weight_bytes: int
    bytes_per_block: int
    page_spec: PageSpec  # what a token costs in one layer's pages (the model's attention says)
    lora_targets: list[str]  # projections (HF naming) adapters may target; [] without LoRA

    def determine_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int: ...
    def allocate_kv_cache(self, num_blocks: int, swap_blocks: int = 0) -> None: ...
    def capture_graphs(self, max_num_seqs: int) -> None: ...
    def execute(self, so: SchedulerOutput) -> RunnerOutput: ...
    def launch(self, so: SchedulerOutput) -> StepHandle: ...
    def shutdown(self) -> None: ...


class StepHandle(Protocol):
    """A step started by `launch`; `result()` waits for it (called once)."""

    def result(self) -> RunnerOutput: ...


class DoneStep:
    """A step that already ran to the end (executors that cannot overlap steps)."""

    def __init__(self, out: RunnerOutput):
        self.out = out

    def result(self) -> RunnerOutput:
        return self.out


class RankGroupExecutor:
    """The engine surface shared by executors that drive one worker per rank: every call
    goes to all ranks through `_run` (one transport per subclass), rank 0 answers."""

    _finalizer: object  # set by subclasses: stops the workers, idempotent

    def _adopt(self, info: dict) -> None:
        """Sizes reported by rank 0 (per device: what one rank holds)."""
        self.device = info["device"]
        self.dtype = info["dtype"]
        self.vocab_size = info["vocab_size"]
        self.weight_bytes = info["weight_bytes"]
        self.bytes_per_block = info["bytes_per_block"]
        self.page_spec = info["page_spec"]
        self.lora_targets = info["lora_targets"]

    def _run(self, method: str, args: tuple) -> list:
        raise NotImplementedError

    def determine_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """The smallest over ranks: a block id means the same slot on every rank."""
        return min(self._run("determine_num_blocks", (max_num_batched_tokens, max_num_seqs)))

    def allocate_kv_cache(self, num_blocks: int, swap_blocks: int = 0) -> None:
        self._run("allocate_kv_cache", (num_blocks, swap_blocks))

    def capture_graphs(self, max_num_seqs: int) -> None:
        self._run("capture_graphs", (max_num_seqs,))

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return self._run("execute", (so,))[0]

    def launch(self, so: SchedulerOutput) -> StepHandle:
        return DoneStep(self.execute(so))

    def shutdown(self) -> None:
        self._finalizer()
