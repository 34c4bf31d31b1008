"""A user's request -> the engine core's requests: tokenized, checked, fanned out over n.

Everything a client can get wrong is checked here, in the front end, against the sizes the
core reported at start (vocabulary, context length, pool), so a bad request fails in the
caller with a ValueError and never reaches the core's queue.
"""

from __future__ import annotations

import json
import os
import time

from pagedllm.engine.messages import CoreInfo, EngineCoreRequest
from pagedllm.engine.token_ids import token_ids_in_range
from pagedllm.lora_request import LoRARequest
from pagedllm.model_executor.lora.peft import inspect_adapter
from pagedllm.pooling_params import PoolerConfig, PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import validate_structured_outputs

MAX_LOGPROBS = 20  # the default cap (EngineConfig.max_logprobs, --max-logprobs)


def child_id(request_id: str, index: int, n: int) -> str:
    """The core's id of sequence `index` of a request with n sequences."""
    return request_id if n == 1 else f"{request_id}#{index}"


def eos_token_ids(hf_config, tokenizer, model_path: str) -> list[int]:
    """Every id that ends a sequence: the model config's, the tokenizer's and
    generation_config.json's (chat models often list several there)."""
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(x) for x in src)
    gen_cfg = os.path.join(model_path, "generation_config.json")
    if os.path.isdir(model_path) and os.path.exists(gen_cfg):
        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


class Processor:
    def __init__(self, tokenizer, info: CoreInfo, eos_ids: list[int],
                 max_logprobs: int = MAX_LOGPROBS, pooler_config: PoolerConfig | None = None):
        self.tokenizer = tokenizer
        self.info = info
        self.eos_ids = eos_ids
        self.pooler_config = pooler_config or PoolerConfig()
        # -1: as many as the vocabulary has (every alternative of every token).
        self.max_logprobs = info.vocab_size if max_logprobs == -1 else max_logprobs
        self._adapters_seen: dict[int, str] = {}  # adapter id -> the path checked for it

    def check_lora(self, lora: LoRARequest | None) -> None:
        """ValueError for an adapter the engine cannot run (LoRA off, a missing file, a rank
        above max_lora_rank, a module no LoRA layer serves), read from the folder's config
        and header once per adapter id and path."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.info.max_lora_rank:
            raise ValueError("a LoRA adapter was requested but LoRA is off "
                             "(enable_lora=True, --enable-lora)")
        if self._adapters_seen.get(lora.lora_int_id) == lora.lora_path:
            return
        info = inspect_adapter(lora.lora_path, self.info.max_lora_rank)
        served = set(self.info.lora_targets)
        for module in info.modules:
            if module not in served:
                raise ValueError(f"LoRA adapter {lora.lora_path!r}: this model has no LoRA layer "
                                 f"for target module {module}")
        self._adapters_seen[lora.lora_int_id] = lora.lora_path

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs the tokenizer (skip_tokenizer_init=False)")
        return self.tokenizer.encode(prompt)

    def encode_many(self, prompts: list[str]) -> list[list[int]]:
        """Several texts at once: a transformers tokenizer encodes a batch in parallel (in
        its Rust core), far faster than one call per text; the ids are the same."""
        from transformers import PreTrainedTokenizerBase

        if self.tokenizer is None or not isinstance(self.tokenizer, PreTrainedTokenizerBase):
            return [self.encode(p) for p in prompts]
        return [list(ids) for ids in self.tokenizer(prompts)["input_ids"]]

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """ValueError for what the model cannot take; returns the resolved max_tokens."""
        vocab, limit = self.info.vocab_size, self.info.max_model_len
        if not token_ids_in_range(prompt_token_ids, vocab):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs} "
                                 f"(max_logprobs, --max-logprobs), got {value}")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt must contain at least one token")
        if n >= limit:
            raise ValueError(f"the prompt has {n} tokens; this model's maximum context length "
                             f"is {limit} including at least one generated token")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        need = min(n + max_tokens, limit)
        if need > self.info.pool_tokens:
            raise ValueError(f"the request needs {need} tokens of KV cache (prompt {n} + "
                             f"max_tokens {max_tokens}) but the whole pool holds "
                             f"{self.info.pool_tokens}")
        return max_tokens

    def process(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                params: SamplingParams, lora_request: LoRARequest | None = None,
                ) -> tuple[list[int], list[SamplingParams], list[EngineCoreRequest]]:
        """(prompt token ids, each sequence's settings, the core requests) of one request."""
        self.check_lora(lora_request)
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(prompt or "")
        prompt_token_ids = list(prompt_token_ids)
        max_tokens = self.check(prompt_token_ids, params)
        # Last: compiling costs more than every other check (once per constraint: cached).
        validate_structured_outputs(params, self.tokenizer, self.info.vocab_size)
        now = time.monotonic()
        seq_params, requests = [], []
        for i in range(params.n):
            p = params.clone()
            p.max_tokens = max_tokens
            if params.seed is not None and i:
                p.seed = params.seed + i  # n samples of one seeded request differ
            if i:
                p.prompt_logprobs = None  # the prompt is reported once
            seq_params.append(p)
            requests.append(EngineCoreRequest(child_id(request_id, i, params.n), prompt_token_ids,
                                              p, self.eos_ids, now, lora_request))
        return prompt_token_ids, seq_params, requests

    def process_pooling(self, request_id: str, prompt: str | None,
                        prompt_token_ids: list[int] | None, params: PoolingParams | None = None,
                        truncate_prompt_tokens: int | None = None
                        ) -> tuple[list[int], EngineCoreRequest]:
        """(prompt token ids, the core request) of one embedding. `truncate_prompt_tokens`
        keeps the prompt's last k tokens (-1: as many as the context holds); without it a
        prompt longer than the context is refused."""
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(prompt or "")
        ids = list(prompt_token_ids)
        vocab, limit = self.info.vocab_size, self.info.max_model_len
        if truncate_prompt_tokens is not None:
            k = limit if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if not 1 <= k <= limit:
                raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {limit}], got "
                                 f"{truncate_prompt_tokens}")
            ids = ids[-k:]
        if not token_ids_in_range(ids, vocab):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise ValueError("the input must contain at least one token")
        if len(ids) > min(limit, self.info.pool_tokens):
            raise ValueError(f"the input has {len(ids)} tokens; this model's maximum context "
                             f"length is {min(limit, self.info.pool_tokens)}")
        if params is None:
            params = self.pooler_config.params()
        return ids, EngineCoreRequest(request_id, ids, None, [], time.monotonic(), pooling_params=params)
