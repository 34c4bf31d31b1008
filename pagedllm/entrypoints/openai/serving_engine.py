"""What the completion and chat endpoints share: model names, errors, prompt checks,
sampling parameters, and running the engine requests of one API call as one stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import msgspec
from jinja2 import TemplateError
from pydantic import BaseModel

from pagedllm.config import EngineConfig, looks_like_hub_id
from pagedllm.engine.async_engine import (
    AsyncLLM,
    EngineDeadError,
    EngineShutdownError,
    RequestFailedError,
)
from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

from .monitoring import log_accepted, log_finished, logged_stream
from .protocol import (
    MAX_LIBRARY_DEPTH,
    MAX_LIBRARY_ITEMS,
    MIN_LOGPROB,
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    OpenAIRequest,
    SamplingRequest,
    check_bounded,
)
from .serving_models import ServedAdapters
from .structured_outputs import structured_outputs

logger = logging.getLogger(__name__)

# A prompt as the engine takes it: the text (None for token-id prompts) and its token ids.
Prompt = tuple[str | None, list[int]]

class APIError(Exception):
    """An error the client should see as OpenAI's error object with this HTTP status (and
    these headers, e.g. Retry-After). The message is all a client learns: never a traceback,
    a file path or the text of an unexpected exception."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def served_model_names(config: EngineConfig) -> list[str]:
    return list(config.served_model_name or [config.model_name])


def model_root(config: EngineConfig) -> str:
    """The model the served names stand for (/v1/models' `root`): a hub id as given, else
    the path's last component. vLLM lists the path itself, which would tell every client
    where this server keeps its files."""
    if looks_like_hub_id(config.model):
        return config.model
    return config.model.rstrip("/").rsplit("/", 1)[-1]


def model_aliases(config: EngineConfig) -> set[str]:
    """Every name a request may use: the served names, the model path or hub id, its last
    component, and for a .gguf file that component without the suffix."""
    path = config.model.rstrip("/")
    last = path.rsplit("/", 1)[-1]
    names = {*served_model_names(config), path, last}
    if last.endswith(".gguf"):
        names.add(last[: -len(".gguf")])
    return names


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)  # -inf is not JSON


def sse(payload: BaseModel | dict | str) -> str:
    """One server-sent event in OpenAI's framing."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")

_encode_json = msgspec.json.Encoder().encode


def sse_plain(chunk: dict) -> bytes:
    """One event from a chunk written as plain dicts and lists, encoded by msgspec: most
    events of a stream (a few characters of text) skip building and dumping pydantic
    models, a large share of the server's time per token. msgspec writes the compact,
    UTF-8 JSON that `model_dump_json` writes (a test compares the two)."""
    return b"data: " + _encode_json(chunk) + b"\n\n"


@dataclass
class Delta:
    """What one choice gained since the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool


@dataclass
class DeltaTracker:
    """Turns the engine's cumulative outputs into per-choice deltas for a stream. The
    engine never takes back text it has released, so slicing by what was sent is safe."""

    with_logprobs: bool
    sent: dict[int, tuple[int, int]] = field(default_factory=dict)  # choice -> (chars, tokens)
    finished: set[int] = field(default_factory=set)

    def update(self, choice: int, out: CompletionOutput) -> Delta | None:
        if choice in self.finished:
            return None
        first = choice not in self.sent
        chars, tokens = self.sent.get(choice, (0, 0))
        text, ids = out.text[chars:], out.token_ids[tokens:]
        self.sent[choice] = (max(chars, len(out.text)), len(out.token_ids))
        if out.finish_reason is not None:
            self.finished.add(choice)
        elif not (text or first or (self.with_logprobs and ids)):
            return None
        logprobs = out.logprobs[tokens:] if out.logprobs is not None else None
        return Delta(text, ids, logprobs, out.finish_reason, out.stop_reason, first)


def param_of(message: str, request: BaseModel | None) -> str | None:
    """The request field a validation message names first ('temperature must be ...')."""
    word = message.split(" ", 1)[0]
    return word if request is not None and word in type(request).model_fields else None


class Admission:
    """The cap on waiting sequences (`--max-waiting-requests`): engine sequences (prompts x n
    of each API request) accepted that have no output yet, because they are queued or their
    prompt is being read. Past the cap a new API request is refused with 503 and Retry-After
    at once, so a burst costs the server nothing and the queue (and every queued request's
    wait) stays bounded. One request may hold at most a quarter of the cap, so that no single
    cheap request (many prompts, a large n) can fill the queue and starve everyone else."""

    RETRY_AFTER_S = 1
    SHARE = 4  # one request: at most 1/SHARE of the cap

    def __init__(self, max_waiting: int = 0):
        self.max_waiting = max_waiting  # 0: no cap
        self.waiting = 0

    @property
    def max_per_request(self) -> int:
        return max(1, self.max_waiting // self.SHARE)

    def check(self, k: int, param: str = "n") -> None:
        """400 for a request of `k` sequences that may never be admitted (cheap: call it
        before the request's prompts are read)."""
        if self.max_waiting and k > self.max_per_request:
            raise APIError(f"this request asks for {k} sequences (prompts x n); one request may "
                           f"hold at most {self.max_per_request}, a quarter of the "
                           f"{self.max_waiting} the server queues (--max-waiting-requests)",
                           400, param)

    def enter(self, k: int) -> None:
        cap = self.max_waiting
        self.check(k)
        if cap and self.waiting + k > cap:
            raise APIError(f"The server is overloaded: {self.waiting} sequences are already "
                           "waiting. Please retry later.", 503, code="server_overloaded",
                           headers={"Retry-After": str(self.RETRY_AFTER_S)})
        self.waiting += k

    def leave(self, k: int) -> None:
        self.waiting -= k


class OpenAIServing:
    # The route these requests came by, for --log-requests lines.
    endpoint = "engine"
    # --log-requests: one line when a request is accepted, one when it ends.
    log_requests = False

    def __init__(self, engine: AsyncLLM, config: EngineConfig, chat_template: str | None = None,
                 admission: Admission | None = None, max_response_logprobs: int = 0,
                 sampling_defaults: dict | None = None, adapters: ServedAdapters | None = None):
        """`sampling_defaults`: SamplingParams fields (generation_config.json's, see
        engine/generation_config.py) for requests that leave them out; `adapters`: the
        LoRA adapters served (shared by every endpoint)."""
        self.engine = engine
        self.sampling_defaults = dict(sampling_defaults or {})
        self.max_logprobs = config.max_logprobs  # -1: no cap here (the vocabulary's)
        self.admission = admission or Admission()
        self.max_response_logprobs = max_response_logprobs  # 0: no limit
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.chat_template = chat_template
        self.served_names = served_model_names(config)
        self.aliases = model_aliases(config)
        self.adapters = adapters or ServedAdapters(lambda lora: engine.processor.check_lora(lora))

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def response_model(self, request: BaseModel | None) -> str:
        """The model a response names: the LoRA adapter asked for, else the base model."""
        name = getattr(request, "model", None)
        return name if name in self.adapters else self.model_name

    # ------------------------------------------------------------------ checks
    def check_request(self, request: OpenAIRequest) -> None:
        if (request.model is not None and request.model not in self.aliases
                and request.model not in self.adapters):
            names = [*self.served_names, *(a.lora_name for a in self.adapters.all())]
            raise APIError(f"The model `{request.model}` does not exist; this server has "
                           f"{', '.join(names)}.", 404, "model", "model_not_found")
        unknown = request.unknown_fields()
        if unknown:  # names chosen by the client: a few, shortened, quoted
            shown = ", ".join(repr(name[:40]) for name in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            logger.warning("ignoring unsupported request fields: %s%s", shown, more)
        if isinstance(request, SamplingRequest) and request.stream_options and not request.stream:
            raise APIError("stream_options is only allowed with stream=true", 400, "stream_options")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str) -> None:
        limit = self.max_model_len
        if num_prompt_tokens == 0:
            raise APIError("the prompt is empty: it must contain at least one token", 400, prompt_param)
        if num_prompt_tokens >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens, and the prompt "
                           f"has {num_prompt_tokens} tokens (at least one token must be left to "
                           "generate). Please shorten the prompt.", 400, prompt_param,
                           "context_length_exceeded")
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} "
                           f"in the prompt, {max_tokens} for the completion). Please reduce the "
                           "length of the prompt or the completion.", 400, "max_tokens",
                           "context_length_exceeded")

    def check_logprobs(self, value: int | None, param: str) -> None:
        """400 naming the field and the flag for more top logprobs than --max-logprobs."""
        cap = self.max_logprobs
        if value is not None and cap >= 0 and value > cap:
            raise APIError(f"{param} must be at most {cap} (the server's --max-logprobs), got "
                           f"{value}", 400, param)

    def default_max_tokens(self, longest_prompt: int) -> int | None:
        """max_tokens for a request that sent none: generation_config.json's max_new_tokens,
        cut to what the context leaves after the longest prompt; None (the rest of the
        context) without one."""
        default = self.sampling_defaults.get("max_tokens")
        if default is None:
            return None
        room = self.max_model_len - longest_prompt
        return min(default, room) if room >= 1 else default

    def check_response_logprobs(self, token_counts: list[int], n: int, top: int | None,
                                param: str = "logprobs") -> None:
        """400 before the work starts for a response whose logprobs could outgrow the cap:
        each of `n` choices per prompt carries 1 + `top` entries for each of its tokens."""
        cap = self.max_response_logprobs
        if top is None or not cap:
            return
        entries = n * sum(token_counts) * (1 + top)
        if entries > cap:
            raise APIError(f"this request could return {entries} logprob entries (choices x "
                           f"tokens x (1 + {top})); a response may carry at most {cap} "
                           "(--max-response-logprobs). Ask for fewer choices, tokens or top "
                           "logprobs.", 400, param)

    def sampling_params(self, request: SamplingRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        constraint: tuple[str, StructuredOutputsParams] | None = None
                        ) -> SamplingParams:
        """`constraint`: one more output constraint and the field that asked for it (a
        forcing tool_choice), counted with the request's own."""
        try:
            return request.to_sampling_params(max_tokens, logprobs, prompt_logprobs,
                                              structured_outputs(request, constraint),
                                              self.sampling_defaults)
        except ValueError as e:
            param = getattr(e, "param", None) or param_of(str(e), request)
            raise APIError(str(e), 400, param) from None

    # ------------------------------------------------------------------ text
    def require_tokenizer(self):
        if self.tokenizer is None:
            raise APIError("this server runs without a tokenizer: send token ids", 400, "prompt")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.require_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    # No tokenizer averages more characters per token over a whole text: a text longer than
    # this many characters per token of context cannot fit, and is refused unread.
    MAX_CHARS_PER_TOKEN = 64

    def check_text_size(self, chars: int, param: str) -> None:
        """The cheap check before tokenizing: a text that cannot fit is refused at once."""
        if chars > self.max_model_len * self.MAX_CHARS_PER_TOKEN:
            raise APIError(f"the {param} has {chars} characters, more than can fit this "
                           f"model's maximum context length of {self.max_model_len} tokens. "
                           "Please shorten it.", 400, param, "context_length_exceeded")

    async def encode_off_loop(self, text: str) -> list[int]:
        """Tokenize on a worker thread (callers run `check_text_size` first): a long prompt
        then holds up neither health checks nor the streams of other clients."""
        return await asyncio.to_thread(self.encode, text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.require_tokenizer().decode(list(token_ids))

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    template_kwargs: dict | None = None, tools: list[dict] | None = None
                    ) -> Prompt:
        """The chat template applied to the conversation (and the tools, given to the
        template as transformers does), as text and token ids."""
        tok = self.require_tokenizer()
        if self.chat_template is None and getattr(tok, "chat_template", None) is None:
            # Said here, not by the tokenizer: its words name a Python argument, or its path.
            raise APIError("this model has no chat template, so it cannot take chat messages: "
                           "start the server with --chat-template, or send a prompt to "
                           "/v1/completions", 400, "messages")
        conversation = [_template_message(i, m) for i, m in enumerate(messages)]
        extra = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            text = tok.apply_chat_template(
                conversation, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **extra)
        except (TemplateError, ValueError) as e:  # the template's own words, or Jinja's
            raise APIError(f"cannot apply the chat template: {e}", 400, "messages") from None
        except (TypeError, KeyError) as e:  # Python's words ("unsupported operand type(s)")
            logger.info("the chat template failed on a request: %s: %s", type(e).__name__, e)
            raise APIError("cannot apply the chat template to these messages: it met a value "
                           "of a type it cannot handle", 400, "messages") from None
        # The template already wrote the special tokens it wants (BOS, role markers).
        return text, tok.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ running
    async def submit(self, request_id: str, prompts: list[Prompt], params: SamplingParams,
                     request: BaseModel | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Start one engine request per prompt and wait for their first outputs, so that an
        invalid request fails here, before any response has begun; then stream
        (prompt index, cumulative output) pairs. Closing the stream aborts what is left."""
        k = len(prompts) * params.n
        started = time.monotonic()
        self.admission.enter(k)
        logging_on = self.log_requests
        if logging_on:
            log_accepted(request_id, self.endpoint, [len(ids) for _, ids in prompts], params)
        try:
            lora = self.adapters.get(getattr(request, "model", None))
            extra = {} if lora is None else {"lora_request": lora}
            gens = [self.engine.generate(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                         text, ids, params, **extra)
                    for i, (text, ids) in enumerate(prompts)]
            firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
        except BaseException:  # cancelled (client gone, deadline) before its first token
            if logging_on:
                log_finished(request_id, "abort", 0, started)
            raise
        finally:
            self.admission.leave(k)
        errors = [e for e in firsts if isinstance(e, BaseException)]
        if errors:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
            error = as_api_error(errors[0], request)
            if logging_on:
                status = getattr(error, "status", None)
                log_finished(request_id, f"error ({status or type(error).__name__})", 0, started)
            raise error
        if len(gens) == 1:
            stream = _single(gens[0], firsts[0], request)
        else:
            stream = _merge(gens, firsts, request)
        return logged_stream(stream, request_id, started) if logging_on else stream


def _template_message(i: int, m: ChatMessage) -> dict:
    """One message as chat templates take it. The arguments of earlier tool calls are given
    as dicts (templates write them with `tojson`), parsed from OpenAI's JSON text; text that
    is not a JSON object stays text."""
    content = m.content
    if isinstance(content, list):
        if any(p.type != "text" or p.text is None for p in content):
            raise APIError(f"messages[{i}].content: only text parts are supported", 400,
                           "messages")
        content = "\n".join(p.text for p in content)
    message: dict = {"role": m.role, "content": content or ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            args = call.function.arguments
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except (ValueError, RecursionError):  # not JSON, or nested past the stack
                    parsed = None
                args = parsed if isinstance(parsed, dict) else args
            try:  # what Jinja walks is bounded, like chat_template_kwargs
                check_bounded(args, f"messages[{i}].tool_calls[{j}].function.arguments",
                              MAX_LIBRARY_DEPTH, MAX_LIBRARY_ITEMS)
            except ValueError as e:
                raise APIError(str(e), 400, "messages") from None
            entry = {"type": "function", "function": {"name": call.function.name,
                                                      "arguments": args}}
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        message["tool_calls"] = calls
    return message


def as_api_error(e: BaseException, request: BaseModel | None = None) -> BaseException:
    """What the client is told. The engine's own errors carry messages written for clients;
    anything else is named by its type alone (its text may hold paths or internals)."""
    if isinstance(e, APIError | asyncio.CancelledError):
        return e
    if isinstance(e, EngineShutdownError):  # as the drain answers new requests
        return APIError(str(e), 503, code="shutting_down", headers={"Retry-After": "1"})
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 503, code="engine_unavailable")
    if isinstance(e, RequestFailedError):
        return APIError(str(e), 500, code="generation_failed")
    if isinstance(e, ValueError):
        return APIError(str(e), 400, param_of(str(e), request))
    logger.error("request failed", exc_info=e)
    return APIError(f"internal server error ({type(e).__name__}); see the server log", 500)


async def _single(gen, first: RequestOutput, request: BaseModel | None
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """One engine stream as (0, output) pairs: no pump task and no queue in between."""
    try:
        yield 0, first
        async for out in gen:
            yield 0, out
    except asyncio.CancelledError:
        raise
    except Exception as e:
        raise as_api_error(e, request) from None
    finally:
        await gen.aclose()


async def _merge(gens: list, firsts: list[RequestOutput], request: BaseModel | None
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several engine streams, interleaved as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, done))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        for i, first in enumerate(firsts):
            yield i, first
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, BaseException):
                raise as_api_error(item, request)
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
