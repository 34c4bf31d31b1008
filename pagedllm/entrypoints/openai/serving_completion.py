"""POST /v1/completions: one engine request per prompt, choices numbered prompt-major
(prompt i, sample j -> index i * n + j), logprobs in OpenAI's legacy shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from pagedllm.outputs import PositionLogprobs, RequestOutput

from .protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
)
from .serving_engine import (
    SSE_DONE,
    APIError,
    DeltaTracker,
    OpenAIServing,
    Prompt,
    as_api_error,
    clamp_logprob,
    random_id,
    sse,
    sse_plain,
)


class OpenAIServingCompletion(OpenAIServing):
    endpoint = "/v1/completions"

    async def create(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """The response, or for stream=true the server-sent events of one."""
        self.check_request(req)
        if req.suffix:
            raise APIError("suffix is not supported", 400, "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of must equal n: ranking samples is not supported", 400, "best_of")
        p = req.prompt
        self.admission.check((1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)) * req.n)
        self.check_logprobs(req.logprobs, "logprobs")
        prompts = await self._prompts(req.prompt)
        # echo with max_tokens=0 scores the prompt: run one token and drop it.
        scoring = req.max_tokens == 0 and bool(req.echo)
        max_tokens = 1 if scoring else req.max_tokens
        if "max_tokens" not in req.model_fields_set and "max_tokens" in self.sampling_defaults:
            # Unsent, not "sent as 16": the schema's default gives way to the model's.
            max_tokens = self.default_max_tokens(max(len(ids) for _, ids in prompts))
        for _, ids in prompts:
            self.check_length(len(ids), max_tokens, "prompt")
        self.check_response_logprobs(
            [(len(ids) if req.echo else 0) + (max_tokens or self.max_model_len - len(ids))
             for _, ids in prompts], req.n, req.logprobs)
        prompt_logprobs = req.logprobs if req.echo else None
        params = self.sampling_params(req, max_tokens, req.logprobs, prompt_logprobs)
        request_id = random_id("cmpl")
        outputs = await self.submit(request_id, prompts, params, req)
        run = _Run(self, req, request_id, prompts, scoring)
        if req.stream:
            return run.stream(outputs)
        return await run.collect(outputs)

    async def _prompts(self, prompt: str | list) -> list[Prompt]:
        if isinstance(prompt, str):
            self.check_text_size(len(prompt), "prompt")
            return [(prompt, await self.encode_off_loop(prompt))]
        if not prompt:
            raise APIError("prompt must not be empty", 400, "prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        for p in prompt:  # every size checked before any prompt is tokenized
            if isinstance(p, str):
                self.check_text_size(len(p), "prompt")
        return [(p, await self.encode_off_loop(p)) if isinstance(p, str) else (None, list(p))
                for p in prompt]


class _Run:
    """The state of answering one completion request."""

    def __init__(self, serving: OpenAIServingCompletion, req: CompletionRequest, request_id: str,
                 prompts: list[Prompt], scoring: bool):
        self.serving, self.req, self.id, self.scoring = serving, req, request_id, scoring
        self.prompts = prompts
        self.model = serving.response_model(req)

    def echo_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        if not self.req.echo:
            return ""
        return text if text is not None else self.serving.decode(ids)

    def logprobs(self, out: RequestOutput, token_ids: list[int],
                 entries: list[PositionLogprobs] | None, echo: bool, offset: int
                 ) -> CompletionLogprobs | None:
        """Legacy logprobs of the echoed prompt (when `echo`) and then of `token_ids`."""
        if self.req.logprobs is None:
            return None
        lp = CompletionLogprobs()
        parts = [(token_ids, entries or [], offset)]
        if echo:  # the prompt's tokens come first and start the text
            parts.insert(0, (out.prompt_token_ids, out.prompt_logprobs or [], 0))
        for ids, ents, offset in parts:
            for tid, entry in zip(ids, ents, strict=False):
                chosen = entry.get(tid) if entry else None
                tok = self.serving.token_str(tid, chosen)
                lp.tokens.append(tok)
                lp.text_offset.append(offset)
                offset += len(tok)
                lp.token_logprobs.append(clamp_logprob(chosen.logprob) if chosen else None)
                lp.top_logprobs.append(
                    {self.serving.token_str(t, v): clamp_logprob(v.logprob) for t, v in entry.items()}
                    if entry else None)
        return lp

    def usage(self, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = 0 if self.scoring else sum(
            len(o.token_ids) for out in finals.values() for o in out.outputs)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                         total_tokens=prompt + completion)

    async def collect(self, outputs) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs):
            async for i, out in outputs:
                finals[i] = out
        choices = []
        for i in range(len(self.prompts)):
            out, echo = finals[i], self.echo_text(i)
            for o in out.outputs:
                ids, entries = ([], []) if self.scoring else (o.token_ids, o.logprobs)
                choices.append(CompletionChoice(
                    index=i * self.req.n + o.index,
                    text=echo + ("" if self.scoring else o.text),
                    logprobs=self.logprobs(out, ids, entries, bool(self.req.echo), len(echo)),
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        return CompletionResponse(id=self.id, model=self.model, choices=choices,
                                  usage=self.usage(finals))

    async def stream(self, outputs) -> AsyncIterator[str | bytes]:
        # Every chunk of one response carries the same id, creation time and model.
        head = {"id": self.id, "object": "text_completion", "created": now(), "model": self.model}
        tracker = DeltaTracker(with_logprobs=self.req.logprobs is not None)
        offsets: dict[int, int] = {}  # choice -> characters sent (for text_offset)
        finals: dict[int, RequestOutput] = {}
        try:
            async with aclosing(outputs):
                async for i, out in outputs:
                    finals[i] = out
                    for o in out.outputs:
                        index = i * self.req.n + o.index
                        d = tracker.update(index, o)
                        if d is None:
                            continue
                        echo = self.echo_text(i) if d.first else ""
                        ids, entries, text = d.token_ids, d.logprobs, d.text
                        if self.scoring:
                            ids, entries, text = [], [], ""
                        if self.req.logprobs is None:  # most events: text alone
                            yield sse_plain({**head, "choices": [{
                                "index": index, "text": echo + text, "logprobs": None,
                                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}],
                                "usage": None})
                            continue
                        offset = offsets.get(index, 0)
                        logprobs = self.logprobs(out, ids, entries, bool(echo), offset + len(echo))
                        offsets[index] = offset + len(echo) + len(text)
                        choice = CompletionChoice(index=index, text=echo + text, logprobs=logprobs,
                                                  finish_reason=d.finish_reason,
                                                  stop_reason=d.stop_reason)
                        yield sse(CompletionResponse(**head, choices=[choice]))
            if self.req.include_usage:
                yield sse(CompletionResponse(**head, choices=[], usage=self.usage(finals)))
        except Exception as e:  # the response has begun: the error is its last event
            yield sse(as_api_error(e).body())
        yield SSE_DONE
