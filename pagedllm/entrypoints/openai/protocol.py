"""Request and response bodies of the OpenAI API, as pydantic models.

Requests accept OpenAI's fields plus vLLM's extra sampling fields (sent by the official
client through `extra_body`), and turn themselves into one `SamplingParams`, so the
completion and chat endpoints share a single translation. Unknown fields are kept (and
logged by the server) rather than rejected: newer clients send fields we do not know yet.

What a request may ask for is bounded here, before anything is tokenized or queued: no NaN or
infinity, no string that is not Unicode (lone surrogates from JSON escapes), integers that fit
the tensors they become, and caps on n and on the lists each engine step walks per request
(stop strings, stop token ids, logit biases), so one request cannot slow every other one.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# Larger than any real logprob and still valid JSON (JSON has no -Infinity).
MIN_LOGPROB = -9999.0

# Limits on one request (OpenAI allows n up to 128 too).
MAX_N = 128
MAX_STOP = 64  # stop strings, each searched for after every token
MAX_TOKEN_LIST = 1024  # stop_token_ids and logit_bias entries, applied at every step
# What a request hands to a library (the chat template's extra arguments go to Jinja):
# nesting and element count bounded, so no template walks an arbitrarily deep or wide value.
MAX_LIBRARY_DEPTH = 8
MAX_LIBRARY_ITEMS = 1024
# JSON Schemas (response formats, tool parameters) go to the template and the grammar
# compiler: real ones nest deeper (two levels per object level), so their bound is wider.
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_ITEMS = 4096
# A seed or top_k becomes a 64-bit integer in a tensor or a generator.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def check_bounded(value: Any, name: str, max_depth: int = MAX_LIBRARY_DEPTH,
                  max_items: int = MAX_LIBRARY_ITEMS) -> None:
    """ValueError naming `name` and the bound if `value` nests deeper than `max_depth` or
    holds more than `max_items` elements (lists and dicts, counted over the whole value)."""
    items = 0
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > max_depth:
                raise ValueError(f"{name} nests deeper than {max_depth} levels")
            children = v.values() if isinstance(v, dict) else v
            items += len(v)
            if items > max_items:
                raise ValueError(f"{name} holds more than {max_items} elements")
            stack.extend((c, depth + 1) for c in children)


class FieldError(ValueError):
    """A bad request field: the message and the field (`param` of OpenAI's error), also when
    raised inside a validator (pydantic keeps the exception, so the server can name it)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def first_non_unicode(value: Any, path: str = "") -> str | None:
    """Where the first string that is not valid Unicode is ('messages[0].content'), else
    None. JSON can spell lone surrogates ('\\ud800'), which no tokenizer takes and no UTF-8
    response can carry; the path never echoes the bad string itself."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "a string"
        return None
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        return None
    for key, item in children:
        if isinstance(key, str) and first_non_unicode(key):
            return f"a key of {path}" if path else "a key"
        bad = first_non_unicode(item, f"{path}[{key}]" if isinstance(key, int)
                                else f"{path}.{key}".lstrip("."))
        if bad:
            return bad
    return None


def now() -> int:
    return int(time.time())


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None  # None: the one model this server has

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        bad = first_non_unicode(data)
        if bad:
            field = bad.removeprefix("a key of ").split("[", 1)[0].split(".", 1)[0]
            param = field if isinstance(data, dict) and field in data else None
            raise FieldError(param, f"{bad} is not valid Unicode text (it holds a lone surrogate)")
        return data

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(BaseModel):
    include_usage: bool | None = False


def _bounded_schema(value: Any, name: str) -> Any:
    if value is not None:
        check_bounded(value, name, MAX_SCHEMA_DEPTH, MAX_SCHEMA_ITEMS)
    return value


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`. `strict` is accepted: the schema is always
    enforced when the engine has a grammar backend."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded_schema(value, "response_format")


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` object: exactly one constraint (checked with the rest)."""

    model_config = ConfigDict(populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(max_length=MAX_LIBRARY_ITEMS)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    @field_validator("json_")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        return _bounded_schema(value, "structured_outputs")


class SamplingRequest(OpenAIRequest):
    """The fields completions and chat share, and their translation to `SamplingParams`."""

    n: int = Field(default=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    # OpenAI's range: -100 bans a token, 100 forces it.
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_TOKEN_LIST)] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters.
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_TOKEN_LIST)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constraints on the output (at most one): OpenAI's, vLLM's, and vLLM's older fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(max_length=MAX_LIBRARY_ITEMS)] | None = None
    guided_grammar: str | None = None

    @field_validator("guided_json")
    @classmethod
    def _bounded_guided_json(cls, value: Any) -> Any:
        return _bounded_schema(value, "guided_json")

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None = None,
                           structured_outputs: StructuredOutputsParams | None = None,
                           defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError naming the field for an out-of-range value. The constraint
        comes from structured_outputs.py, which reads this request's constraint fields.
        `defaults` are the server's (from generation_config.json): they fill only the
        sampling fields the client left out or sent as null, never one it set."""
        defaults = defaults or {}

        def pick(name: str, fallback: float) -> float:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            structured_outputs=structured_outputs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------------- shared responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str  # vLLM's optional lora_int_id is ignored: names are unique here


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------- completions
class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    # The cap is the server's --max-logprobs, checked by the endpoint (a 400 naming it).
    logprobs: int | None = Field(default=None, ge=0)
    suffix: str | None = None
    best_of: int | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- chat
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    # OpenAI sends JSON text; a dict is taken too (what templates are given).
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    """A call in an earlier assistant message, sent back with the conversation."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_LIBRARY_ITEMS)] | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded_schema(value, "tools")


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    # At least one: said in the schema, so clients and schema-driven fuzzers know it.
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)  # cap: --max-logprobs
    tools: Annotated[list[ChatTool], Field(max_length=MAX_LIBRARY_ITEMS)] | None = None
    # None: "auto" with tools, "none" without (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded_template_arguments(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_bounded(value, "chat_template_kwargs")
        return value


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the answer is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # reasoning and tool calls only when there are some
        out = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # chat_output.CallDelta.to_dict()

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # a delta carries only what changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------- tokenization
class TokenizeRequest(OpenAIRequest):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# OpenAI's cap on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(OpenAIRequest):
    """POST /v1/embeddings. `input` is checked by the server (serving_embedding.py), which
    names the bad item; vLLM's `truncate_prompt_tokens` keeps each input's last k tokens."""

    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
