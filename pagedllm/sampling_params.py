"""How one request wants its tokens chosen and when it wants to stop.

Field names and meanings follow vLLM's `SamplingParams` so users can switch without
relearning anything. Validation happens at construction so a bad value fails at the API
boundary, naming the field, instead of deep inside a batched step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, as vLLM's `StructuredOutputsParams`: exactly one of
    `json` (a JSON Schema, as a dict or its text), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (EBNF / GBNF text).

    The constraint is compiled by the engine's grammar backend and enforced token by token
    with a mask on the logits; the text a request returns then always matches it (unless
    the request ends first, by max_tokens or a stop string)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON output without free whitespace between tokens (fewer tokens, as compact JSON).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, "
                             f"regex, choice or grammar, got {given or 'none'}")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON Schema (an object or "
                             "its text)")

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine, not by users.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats: {e}") from None
        self._validate()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", "must not exceed max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be a non-negative integer")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be a non-negative integer")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias and any(abs(v) > 100 for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
