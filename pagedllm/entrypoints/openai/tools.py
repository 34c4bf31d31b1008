"""Tool calling on /v1/chat/completions: checking `tools` and `tool_choice`, what the chat
template is given, and how the answer becomes tool calls.

- "none": the template still sees the tools (as vLLM does); the answer is plain content.
- "auto": the model may call; its free text is read by the `--tool-call-parser` (only with
  `--enable-auto-tool-choice`, as in vLLM, since without a parser a call would come back
  as raw text).
- "required" or one named function: the engine's grammar holds the answer to a JSON list of
  `{"name": ..., "arguments": ...}` objects (schema below), which becomes the tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.sampling_params import StructuredOutputsParams

from .cli_args import ChatOptions
from .protocol import ChatCompletionRequest, ChatTool
from .serving_engine import APIError
from .tool_parsers import ForcedToolParser, ToolParser, get_tool_parser

MAX_NAME_CHARS = 256


@dataclass
class ToolPlan:
    """What one request's tools mean for the prompt, the constraint and the answer."""

    template_tools: list[dict] | None  # OpenAI's tool objects, as chat templates take them
    parser: ToolParser | None  # None: the answer is content only
    constraint: StructuredOutputsParams | None  # "required" / a named function
    single_call: bool  # parallel_tool_calls=false, or a named function


def _parameters(tool: ChatTool, i: int) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None:  # OpenAI: a function without parameters
        return {"type": "object", "properties": {}}
    if params.get("type", "object") != "object":
        raise APIError(f"tools[{i}].function.parameters must be the JSON Schema of an object "
                       f"(type \"object\"), got type {params.get('type')!r}", 400, "tools")
    return params


def check_tools(tools: list[ChatTool]) -> list[dict]:
    """400 for an unnamed or repeated function or parameters that are not an object's
    schema; else the tools as templates take them (parameters filled in)."""
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name.strip():
            raise APIError(f"tools[{i}].function.name must not be empty", 400, "tools")
        if len(name) > MAX_NAME_CHARS:
            raise APIError(f"tools[{i}].function.name is longer than {MAX_NAME_CHARS} characters",
                           400, "tools")
        if name in seen:
            raise APIError(f"tools[{i}].function.name {name!r} is given twice: function names "
                           "must be unique", 400, "tools")
        seen.add(name)
        function = tool.function.model_dump(exclude_none=True)
        function["parameters"] = _parameters(tool, i)
        out.append({"type": "function", "function": function})
    return out


def calls_schema(tools: list[dict], single: bool) -> dict:
    """The JSON Schema of a forced answer: a list of at least one call of these tools, each
    `{"name": <one of them>, "arguments": <that tool's parameters>}`."""
    options = [{"type": "object",
                "properties": {"name": {"const": t["function"]["name"]},
                               "arguments": t["function"]["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
               for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if single:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: ChatCompletionRequest, options: ChatOptions) -> ToolPlan:
    tools = check_tools(req.tools) if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    single = req.parallel_tool_calls is False
    if not tools:
        if choice in ("none", "auto"):
            return ToolPlan(None, None, None, single)
        raise APIError("tool_choice asks for a tool call, but the request gives no tools", 400,
                       "tool_choice")
    if choice == "none":
        return ToolPlan(tools, None, None, single)
    if choice == "auto":
        if not (options.enable_auto_tool_choice and options.tool_call_parser):
            raise APIError('tool_choice "auto" (the default when tools are given) needs a '
                           "server started with --enable-auto-tool-choice and "
                           "--tool-call-parser; or send tool_choice \"required\", \"none\" or "
                           "a named function", 400, "tool_choice")
        return ToolPlan(tools, get_tool_parser(options.tool_call_parser), None, single)
    if choice == "required":
        chosen = tools
    else:
        chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not chosen:
            raise APIError(f"tool_choice names the function {choice.function.name!r}, which is "
                           "not among the request's tools", 400, "tool_choice")
        single = True
    # Compact JSON: no room for a small model to wander off into whitespace.
    constraint = StructuredOutputsParams(json=calls_schema(chosen, single),
                                         disable_any_whitespace=True)
    return ToolPlan(tools, ForcedToolParser(), constraint, single)
