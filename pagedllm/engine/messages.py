"""The plain data that crosses between the front end and the engine core.

The core takes `EngineCoreRequest`s (token ids and sampling settings: no text, no n) and
answers each step with one `EngineCoreOutputs`: per sequence only what is new since the
last step (token ids, their logprobs, a finish reason), plus the pool's numbers. The same
objects travel in-process (the offline `LLM`) and as msgpack over a socket (the server's
core process), so what the core sends is small and never a cumulative copy.
"""

from __future__ import annotations

import msgspec

from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# (token ids, logprobs, ranks) of one position: the chosen token first, then the top ones.
PositionEntry = tuple[list[int], list[float], list[int]]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence to generate. A user request with n > 1 arrives as n of these.

    A pooling request (an embedding) has `pooling_params` and no sampling settings: it
    reads its prompt and ends with one vector (`EngineCoreOutput.pooled`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # max_tokens already resolved (never None)
    eos_token_ids: list[int]
    arrival_time: float
    lora_request: LoRARequest | None = None  # None: the base model
    pooling_params: PoolingParams | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence gained in one step."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[PositionEntry] | None = None  # one entry per new token
    new_prompt_logprobs: list[PositionEntry] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "error"
    stop_reason: int | None = None  # the stop token id (stop strings are the front end's)
    num_cached_tokens: int = -1  # set with the first token: prompt tokens found in the cache
    scheduled_time: float | None = None  # set with the first token: first scheduling
    error: str | None = None  # why the core failed this sequence (finish_reason "error")
    pooled: bytes | None = None  # a pooling request's vector: little-endian float32


class SchedulerStats(msgspec.Struct, array_like=True):
    """The pool and queue after a step: what /metrics, /v1/engine/stats and the dashboard show."""

    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    # Speculative decoding, cumulative: verified chunks, draft tokens proposed in them,
    # drafts accepted, and accepted drafts by position (index 0: the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Multi-LoRA: the adapters (names) of the running and of the waiting sequences.
    running_loras: list[str] = []
    waiting_loras: list[str] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One message from the core: a step's outputs, or the core's death notice."""

    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    dead: str | None = None  # the core stopped: the message clients get (no internals)


class CoreInfo(msgspec.Struct):
    """What the core tells the front end once it has started: sizes the front end checks
    requests against, and the settings an operator tunes by (the start-up banner)."""

    vocab_size: int
    max_model_len: int
    pool_tokens: int
    describe: dict
    async_scheduling: bool
    max_lora_rank: int = 0  # 0: LoRA is off
    lora_targets: list[str] = []  # the projections (HF naming) an adapter may target


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


# What the front end sends the core.
CoreCommand = AddRequest | AbortRequests | Shutdown
