"""The offline engine: the front end (tokenize, fan out, detokenize, stop strings) around
an engine core in the same process, stepped by the caller.

Synchronous and single-threaded on purpose: the offline `LLM` calls `step()` in a loop.
The server runs the same front end and core, the core in a process of its own
(`pagedllm.engine.async_engine`).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore, StepError
from pagedllm.engine.messages import SchedulerStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import Processor, eos_token_ids
from pagedllm.heap import freeze_startup_heap, thaw_heap
from pagedllm.lora_request import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.model_source import resolve_source
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolerConfig, PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizers import load_tokenizer

__all__ = ["LLMEngine", "StepError", "load_frontend"]


def load_frontend(config: EngineConfig, core_info, hf_config) -> tuple:
    """(tokenizer, Processor) of a front end, for a core that reported `core_info`."""
    source = resolve_source(config.model, config.load_format, config.revision,
                            config.download_dir)
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(source, config.tokenizer)
    processor = Processor(tokenizer, core_info, eos_token_ids(hf_config, tokenizer, source.path),
                          config.max_logprobs, PoolerConfig.from_model(source.path, hf_config))
    return tokenizer, processor


class LLMEngine:
    def __init__(self, config: EngineConfig):
        thaw_heap()  # an earlier engine's frozen garbage goes before this one sizes its pool
        self.core = EngineCore(config)
        self.config = config = self.core.config  # resolved
        try:
            self.tokenizer, self.processor = load_frontend(config, self.core.info(),
                                                           self.core.hf_config)
        except BaseException:
            self.core.shutdown()
            raise
        self.core.use_tokenizer(self.tokenizer)  # one tokenizer, one grammar cache
        self.metrics = EngineMetrics(config.model_name, config.max_loras if config.enable_lora else 0)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.metrics.update_pool(self.stats())
        freeze_startup_heap("offline engine")  # pagedllm/heap.py: why

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op in-process); also done at interpreter exit.
        The heap frozen at startup is thawed: what the engine held can be collected."""
        self.core.shutdown()
        thaw_heap()

    # ------------------------------------------------------------------ the core's parts
    @property
    def executor(self):
        return self.core.executor

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def hf_config(self):
        return self.core.hf_config

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.processor.eos_ids)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def num_kv_blocks(self) -> int:
        return self.core.kv.num_blocks

    def describe(self) -> dict:
        return self.core.describe()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        return self.processor.encode(prompt)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams, lora_request: LoRARequest | None = None) -> None:
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, seq_params, requests = self.processor.process(request_id, prompt, prompt_token_ids, params,
                                                           lora_request)
        added = []
        try:
            for req in requests:
                self.core.add_request(req)
                added.append(req.request_id)
        except ValueError:
            self.core.abort_requests(added)
            raise
        self.output_processor.add(request_id, prompt, ids, seq_params, requests[0].arrival_time)

    def add_pooling_request(self, request_id: str, prompt: str | None,
                            prompt_token_ids: list[int] | None,
                            params: PoolingParams | None = None,
                            truncate_prompt_tokens: int | None = None) -> None:
        """Queue one embedding (its output is an EmbeddingRequestOutput)."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids, request = self.processor.process_pooling(request_id, prompt, prompt_token_ids,
                                                      params, truncate_prompt_tokens)
        self.core.add_request(request)
        self.output_processor.add_pooling(request_id, prompt, ids, request.pooling_params,
                                          request.arrival_time)

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request now and free its blocks; `reason` is its finish reason ("abort",
        or "error" when the engine failed it)."""
        if request_id not in self.output_processor:
            return None
        self.core.abort_requests(self.output_processor.seq_ids(request_id))
        out = self.output_processor.abort(request_id, reason)
        self.metrics.update_pool(self.stats())
        return out

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop
    def step(self, final_only: bool = False) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine iteration: the core's step, then its deltas turned into outputs.
        A step that raises raises StepError naming the user requests it held."""
        try:
            deltas = self.core.step()
        except StepError as e:
            owners = self.output_processor.seq_owner
            raise StepError(list({owners[s][0]: None for s in e.request_ids if s in owners})) from e
        outputs, aborts = self.output_processor.process(deltas, self.core.stats(), final_only)
        if aborts:
            self.core.abort_requests(aborts)
        return outputs
