"""A request as the scheduler sees it: token ids, progress, and why it stopped.

Pure Python (no torch) so the scheduler and block manager can be tested in milliseconds.
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.token_array import as_token_array, token_array


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    """One sequence to generate. `n > 1` is fanned out into n Requests upstream."""

    request_id: str
    # Both id sequences are arrays (pagedllm/core/token_array.py: the garbage collector's full
    # passes never visit their items); lists given here are converted.
    prompt_token_ids: array
    max_tokens: int
    # Token-level stopping; stop *strings* are checked by the output processor.
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    # Prompt logprobs need the logits of every prompt position, so such a request computes
    # its whole prompt instead of taking blocks from the prefix cache (its own full blocks
    # are still cached for the requests after it).
    skip_prefix_cache: bool = False
    # The whole prompt in one step, never in chunks (bidirectional embedding models: every
    # token's state depends on every other token of the input).
    whole_prompt: bool = False
    # A pooling request (an embedding): it reads its prompt, is pooled by the worker at the
    # prompt's last chunk, and ends there (max_tokens 0); it may fill the whole context.
    pooling: bool = False
    # Opaque to the core: the worker reads sampling settings from here.
    sampling_params: Any = None
    # Multi-LoRA: the adapter (opaque, a LoRARequest for the worker) and its id, 0 for the
    # base model. The id keys the prefix cache and caps the adapters of one step.
    lora_request: Any = None
    lora_int_id: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: array = field(default_factory=token_array)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # advanced when a step is scheduled, not when it returns
    # Tokens sampled by steps still in flight (async scheduling): their ids are not known
    # on the host yet, but the next step can already compute them, from device memory.
    num_pending: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet
    num_preemptions: int = 0
    # Preempted with its pages swapped out to host memory (Scheduler, swap_blocks): the
    # host blocks' first index, their count and the tokens they hold; None otherwise.
    swapped: tuple[int, int, int] | None = None
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    first_scheduled_time: float | None = None
    # Speculative decoding: False for a request whose sampling needs every earlier token
    # on the host per position (penalties, min_tokens, a grammar): it never gets drafts.
    allow_spec: bool = True
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = as_token_array(self.prompt_token_ids)
        self.output_token_ids = as_token_array(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens(self, start: int, end: int) -> array:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
