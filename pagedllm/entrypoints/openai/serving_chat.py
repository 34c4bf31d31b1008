"""POST /v1/chat/completions: the conversation (and tools) through the chat template, one
engine request whose n samples are the choices; answers split into reasoning, content and
tool calls by the parsers the server was started with (chat_output.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

from .chat_output import OutputParser, StreamState, call_id
from .cli_args import ChatOptions
from .protocol import (
    MIN_LOGPROB,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCallOut,
    ToolCall,
    TopLogprob,
    UsageInfo,
    now,
)
from .reasoning_parsers import get_reasoning_parser
from .serving_engine import (
    SSE_DONE,
    APIError,
    DeltaTracker,
    OpenAIServing,
    as_api_error,
    clamp_logprob,
    random_id,
    sse,
    sse_plain,
)
from .tools import plan_tools


@dataclass
class ChatRun:
    """A submitted chat request: its id, prompt length, the engine's (choice, cumulative
    output) stream, and the parser of its answer (None: the text is the content)."""

    request_id: str
    prompt_tokens: int
    outputs: AsyncIterator
    parser: OutputParser | None


class OpenAIServingChat(OpenAIServing):
    endpoint = "/v1/chat/completions"

    def __init__(self, *args, options: ChatOptions | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.options = options or ChatOptions()

    async def create(self, req: ChatCompletionRequest
                     ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or for stream=true the server-sent events of one."""
        run = await self.start(req)
        if req.stream:
            return self._stream(req, run.request_id, run.prompt_tokens, run.outputs, run.parser)
        return await self._collect(req, run.request_id, run.outputs, run.parser)

    async def start(self, req: ChatCompletionRequest) -> ChatRun:
        """Check, render and submit a chat request (400s are raised here, before any answer
        has begun); the engine's outputs and the parser of the answer come back. The
        Responses API runs its conversations through this too."""
        self.check_request(req)
        self._check_unsupported(req)
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        self.admission.check(req.n)
        plan = plan_tools(req, self.options)
        self.check_text_size(sum(len(m.content) if isinstance(m.content, str)
                                 else sum(len(p.text or "") for p in m.content)
                                 for m in req.messages if m.content), "messages")
        # The template and the tokenizer run on a worker thread, off the event loop.
        text, ids = await asyncio.to_thread(self.render_chat, req.messages,
                                            req.add_generation_prompt, req.chat_template_kwargs,
                                            plan.template_tools)
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens  # None: the rest of the context
        if max_tokens is None and not {"max_tokens", "max_completion_tokens"} & req.model_fields_set:
            max_tokens = self.default_max_tokens(len(ids))  # generation_config.json's
        self.check_length(len(ids), max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.check_response_logprobs([max_tokens or self.max_model_len - len(ids)], req.n,
                                     logprobs, "top_logprobs")
        params = self.sampling_params(
            req, max_tokens, logprobs,
            constraint=("tool_choice", plan.constraint) if plan.constraint else None)
        if plan.parser is not None and plan.parser.keeps_special_tokens:
            params.skip_special_tokens = False  # its markers are special tokens
        # A constrained answer (JSON, regex, ...) has no room for thinking tags.
        reasoning = (get_reasoning_parser(self.options.reasoning_parser)
                     if self.options.reasoning_parser and params.structured_outputs is None
                     else None)
        if reasoning is not None and reasoning.keeps_special_tokens:
            params.skip_special_tokens = False  # harmony's channels are special tokens
        parser = (OutputParser(reasoning, plan.parser, plan.single_call)
                  if reasoning is not None or plan.parser is not None else None)
        request_id = random_id("chatcmpl")
        outputs = await self.submit(request_id, [(text, ids)], params, req)
        return ChatRun(request_id, len(ids), outputs, parser)

    @staticmethod
    def _check_unsupported(req: ChatCompletionRequest) -> None:
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int],
                  entries: list[PositionLogprobs] | None) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        k = req.top_logprobs or 0
        content = []
        for tid, entry in zip(token_ids, entries or [], strict=False):
            top = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:k]
            chosen = entry.get(tid)
            tok = self.token_str(tid, chosen)
            content.append(ChatLogprobToken(
                token=tok, logprob=clamp_logprob(chosen.logprob) if chosen else MIN_LOGPROB,
                bytes=list(tok.encode()), top_logprobs=[self._top(t, v) for t, v in top]))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: Logprob) -> TopLogprob:
        tok = self.token_str(token_id, logprob)
        return TopLogprob(token=tok, logprob=clamp_logprob(logprob.logprob), bytes=list(tok.encode()))

    @staticmethod
    def _usage(prompt_tokens: int, out: RequestOutput) -> UsageInfo:
        completion = sum(len(o.token_ids) for o in out.outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                         total_tokens=prompt_tokens + completion)

    @staticmethod
    def _message(o: CompletionOutput, parser: OutputParser | None
                 ) -> tuple[AssistantMessage, str | None]:
        """The answer as OpenAI's message, and its finish reason ("tool_calls" when it
        stopped by itself after calling)."""
        if parser is None:
            return AssistantMessage(content=o.text), o.finish_reason
        p = parser.parse(o.text, final=True)
        calls = [ToolCall(id=call_id(), function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in p.calls]
        message = AssistantMessage(content=p.message_content, reasoning_content=p.reasoning,
                                   tool_calls=calls or None)
        return message, _finish_reason(o.finish_reason, bool(calls))

    async def _collect(self, req: ChatCompletionRequest, request_id: str, outputs,
                       parser: OutputParser | None) -> ChatCompletionResponse:
        async with aclosing(outputs):
            async for _, out in outputs:
                final = out
        choices = []
        for o in final.outputs:
            message, finish_reason = self._message(o, parser)
            choices.append(ChatChoice(index=o.index, message=message,
                                      logprobs=self._logprobs(req, o.token_ids, o.logprobs),
                                      finish_reason=finish_reason, stop_reason=o.stop_reason))
        return ChatCompletionResponse(id=request_id, model=self.response_model(req), choices=choices,
                                      usage=self._usage(len(final.prompt_token_ids), final))

    async def _stream(self, req: ChatCompletionRequest, request_id: str, prompt_tokens: int,
                      outputs, parser: OutputParser | None) -> AsyncIterator[str | bytes]:
        # Every chunk of one response carries the same id, creation time and model.
        head = {"id": request_id, "object": "chat.completion.chunk", "created": now(),
                "model": self.response_model(req)}

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(**head, choices=choices, usage=usage))

        def plain(index: int, delta: dict, finish_reason=None, stop_reason=None) -> bytes:
            return sse_plain({**head, "choices": [{
                "index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": stop_reason}], "usage": None})

        tracker = DeltaTracker(with_logprobs=bool(req.logprobs))
        states: dict[int, StreamState] = {}
        final = None
        try:
            async with aclosing(outputs):
                async for _, out in outputs:
                    final = out
                    for o in out.outputs:
                        d = tracker.update(o.index, o)
                        if d is None:
                            continue
                        if d.first:  # OpenAI opens every choice with the role alone
                            yield plain(o.index, {"role": "assistant", "content": ""})
                        finish_reason = d.finish_reason
                        if parser is None:
                            delta = {"content": d.text} if d.text else {}
                        else:  # the whole answer so far, parsed again: send what grew
                            state = states.setdefault(o.index, StreamState(parser))
                            delta = state.update(o.text, final=finish_reason is not None).to_dict()
                            finish_reason = _finish_reason(finish_reason, state.has_calls)
                        if not (delta or finish_reason or (req.logprobs and d.token_ids)):
                            continue
                        if not req.logprobs:  # most events: text alone
                            yield plain(o.index, delta, finish_reason, d.stop_reason)
                            continue
                        yield chunk([ChatStreamChoice(
                            index=o.index, delta=DeltaMessage(**delta),
                            logprobs=self._logprobs(req, d.token_ids, d.logprobs),
                            finish_reason=finish_reason, stop_reason=d.stop_reason)])
            if req.include_usage and final is not None:
                yield chunk([], self._usage(prompt_tokens, final))
        except Exception as e:  # the response has begun: the error is its last event
            yield sse(as_api_error(e).body())
        yield SSE_DONE


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that called and then stopped by itself; one cut
    off by max_tokens keeps "length" (its last call may be incomplete)."""
    return "tool_calls" if called and reason == "stop" else reason
