"""The offline Python API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pagedllm.config import EngineConfig
from pagedllm.engine.generation_config import default_sampling_overrides
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    """Generate for many prompts at once with continuous batching over a paged KV cache.

    Accepts every `EngineConfig` setting as a keyword, including the aliases
    `max_context_length`, `max_concurrent_requests` and `max_tokens_per_batch`.
    `generation_config` ("auto", "vllm" or a folder) picks the default sampling settings
    used when `generate` or `chat` get no SamplingParams (see get_default_sampling_params).
    """

    # embed() tokenizes and queues its prompts this many at a time, the next batch while
    # the device runs the steps of the ones before (a whole 2,048 x 256 batch up front kept
    # the GPU idle for its ~0.1-0.3 s of tokenization).
    EMBED_FEED = 256

    def __init__(self, model: str | None = None, **kwargs):
        if kwargs.get("max_prefill_tokens_with_decodes") is None:
            # Offline there are no streams to keep steady, so no cap on a step's prompt
            # tokens beside decodes unless asked: on an H100 the server's 512 made gpu-moe
            # 1.5x slower (4,671 against 7,013 tok/s: every capped step reads all the
            # experts to admit two prompts) and changed nothing on gpu-7b or gpu-long
            # (benchmarks/results/2026-12-06-gpu-h100-caps-6e9e6ad.json).
            kwargs["max_prefill_tokens_with_decodes"] = 0
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        # Read before the weights load, so a wrong folder fails in a second, not minutes.
        self._default_overrides = default_sampling_overrides(self.config.generation_config,
                                                             self.config.model)
        self.engine = LLMEngine(self.config)
        self._counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) over
        SamplingParams' own, as vLLM's; plain SamplingParams() with generation_config="vllm"
        or when the checkpoint has no such file. Used when no params are given."""
        return SamplingParams(**self._default_overrides)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or a list (one per prompt, None
        for the base model); adapters need enable_lora=True."""
        if self.config.runner == "pooling":
            raise ValueError("this model runs for embeddings only (runner='pooling'): use embed()")
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                rid = str(next(self._counter))
                text, token_ids = self._split_prompt(prompt)
                self.engine.add_request(rid, text, token_ids, p, lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (`out.outputs.embedding`), pooled as the checkpoint says
        (sentence-transformers' files) unless `pooling_params` says otherwise; batched and
        paged like generation. Instruction prefixes are the caller's to add."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        split = [self._split_prompt(p) for p in prompts]
        added: list[str] = []
        next_prompt = 0

        def feed() -> list[str]:
            """Tokenize (as one batch) and queue the next EMBED_FEED prompts: called again
            after each step, so later prompts are tokenized while the device computes."""
            nonlocal next_prompt
            lo, hi = next_prompt, min(len(split), next_prompt + self.EMBED_FEED)
            texts = [i for i in range(lo, hi) if split[i][1] is None]
            if len(texts) > 1:  # tokenized as one batch
                encoded = self.engine.processor.encode_many([split[i][0] or "" for i in texts])
                for i, ids in zip(texts, encoded, strict=True):
                    split[i] = (split[i][0], ids)
            new = []
            for text, token_ids in split[lo:hi]:
                rid = str(next(self._counter))
                self.engine.add_pooling_request(rid, text, token_ids, pooling_params,
                                                truncate_prompt_tokens)
                added.append(rid)
                new.append(rid)
            next_prompt = hi
            return new

        try:
            outs = self._run(feed(), feed if next_prompt < len(split) else None)
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        for out in outs:
            if out.error is not None:
                raise RuntimeError(f"embedding failed: {out.error}")
        return outs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs the tokenizer (skip_tokenizer_init=False)")
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text,
                            "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    # ------------------------------------------------------------------ helpers
    def _params_list(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp

    @staticmethod
    def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt or "prompt" in prompt):
            return prompt.get("prompt"), prompt.get("prompt_token_ids")
        raise ValueError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _run(self, ids: list[str], feed=None) -> list:
        """Step until every request of `ids` has finished; `feed`, if given, is called
        after each step and returns more request ids to wait for (none: it is done)."""
        final: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        order = list(ids)
        pending = set(ids)
        while pending and self.engine.has_unfinished_requests():
            for out in self.engine.step(final_only=True):
                if out.finished:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
            if feed is not None:
                more = feed()
                if more:
                    order += more
                    pending.update(more)
                else:
                    feed = None
        return [final[i] for i in order]


ModelEngine = LLM
