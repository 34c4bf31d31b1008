"""Today's single-device path: the ModelRunner lives in the engine's process."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model_source import ModelSource
from pagedllm.worker.model_runner import ModelRunner, RunnerOutput


class UniprocExecutor:
    """A thin pass-through: no copies, no pickling, nothing added to a step."""

    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, max_model_len: int):
        self.runner = ModelRunner(config, source, hf_config, max_model_len)
        self.device = self.runner.device
        self.dtype = self.runner.dtype
        self.vocab_size = self.runner.vocab_size

    @property
    def model(self):
        return self.runner.model

    @property
    def lora_targets(self) -> list[str]:
        return self.runner.lora.targets() if self.runner.lora is not None else []

    @property
    def weight_bytes(self) -> int:
        return self.runner.weight_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    @property
    def page_spec(self):
        return self.runner.page_spec

    def determine_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        return self.runner.determine_num_blocks(max_num_batched_tokens, max_num_seqs)

    def allocate_kv_cache(self, num_blocks: int, swap_blocks: int = 0) -> None:
        self.runner.allocate_kv_cache(num_blocks, swap_blocks)

    def capture_graphs(self, max_num_seqs: int) -> None:
        self.runner.capture_graphs(max_num_seqs)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute(so)

    # The step's sampling can wait for grammar masks filled while its forward runs.
    supports_deferred_sampling = True

    def launch(self, so: SchedulerOutput, defer_sampling: bool = False):
        """Queued on the device, not waited for: the engine reads it after its next launch."""
        return self.runner.launch(so, defer_sampling)

    def shutdown(self) -> None:
        pass
