"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

A Responses request is a chat conversation in another spelling: its `input` items (and the
stored conversation of `previous_response_id`, and `instructions` as the system message)
become chat messages, `tools` / `tool_choice` / `text.format` become the chat request's
tools and response_format, and the chat endpoint's machinery runs it (template, sampling,
structured output, tool parsing: serving_chat.py). The answer is turned back into output
items: a message with output_text, and function_call items. A stream is the SDK's event
sequence: response.created, response.in_progress, the output items with their
output_text (or function-call argument) deltas, and response.completed (or
response.incomplete when max_output_tokens cut the answer).

Background mode (`background: true`, with `store`): the request is checked and queued on the
engine, and the Response comes back at once with status `queued`; a task of the server
reads the answer and stores it as it ends (`in_progress`, then `completed`, `incomplete`
or `failed`), which `GET /v1/responses/{id}` shows. `POST /v1/responses/{id}/cancel` stops
one that is still running (its engine request is aborted; status `cancelled`).

Not supported: built-in tools (web search, file search, computer use), streaming a
background response, reasoning items, and input that is not text (images, files); they
are refused with a 400.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from pagedllm.outputs import RequestOutput

from .chat_output import StreamState
from .protocol import AssistantMessage, ChatCompletionRequest, OpenAIRequest
from .responses_store import ResponseStore
from .serving_chat import ChatRun, OpenAIServingChat
from .serving_engine import APIError, as_api_error

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesRequest(OpenAIRequest):
    input: str | list[Any]
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool | None = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of text parts", 400, "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            raise APIError(f"{where}.content[{j}]: only text parts (input_text, output_text) "
                           "are supported", 400, "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: str | list[Any]) -> list[dict]:
    """`input` as chat messages: message items, function_call items (as an assistant's
    tool calls; consecutive ones are one message) and function_call_output items (as tool
    messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise APIError("input must not be an empty list", 400, "input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object (a message or a function call item)",
                           400, "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise APIError(f"{where}.role must be one of user, assistant, system, "
                               "developer", 400, "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments")
            if not isinstance(name, str) or not isinstance(args, str):
                raise APIError(f"{where}: a function_call item needs name and arguments "
                               "(strings)", 400, "input")
            call = {"id": str(item.get("call_id") or _id("call")), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise APIError(f"{where}: a function_call_output item needs call_id and output "
                               "(strings)", 400, "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise APIError(f"{where}: items of type {str(kind)[:40]!r} are not supported "
                           "(message, function_call, function_call_output are)", 400, "input")
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a continuation starts from."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": item["content"]})
        elif item["type"] == "function_call":
            items.append(item)
    return input_messages(items) if items else []


def chat_tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """Responses' function tools and tool_choice in the chat spelling."""
    tools = None
    if req.tools is not None:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function":
                raise APIError(f"tools[{i}]: only function tools are supported, got type "
                               f"{str(t.get('type'))[:40]!r}", 400, "tools")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError('tool_choice must be "none", "auto", "required" or '
                           '{"type": "function", "name": ...}', 400, "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def text_format(req: ResponsesRequest) -> dict:
    """`text.format`, checked to be an object with a type ({"type": "text"} if absent)."""
    fmt = (req.text or {}).get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError("text.format must be an object with a type (text, json_object or "
                       "json_schema)", 400, "text")
    return fmt


def response_format(req: ResponsesRequest) -> dict | None:
    """`text.format` as the chat request's response_format."""
    fmt = text_format(req)
    if fmt["type"] == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    raise APIError("text.format.type must be text, json_object or json_schema", 400, "text")


class OpenAIServingResponses:
    endpoint = "/v1/responses"

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore):
        self.chat = chat
        self.store = store
        self._background: dict[str, asyncio.Task] = {}  # running background responses

    # ------------------------------------------------------------------ stored
    def get(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, None)
        return entry.response

    def delete(self, response_id: str) -> dict:
        task = self._background.pop(response_id, None)  # a running one stops and stays gone
        if task is not None:
            task.cancel()
        if not self.store.delete(response_id):
            raise _not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        """Stop a background response that is still running (status `cancelled`); one that
        has ended is returned as it is. Only background responses can be cancelled."""
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id, None)
        if not entry.response.get("background"):
            raise APIError("only responses created with background=true can be cancelled", 400,
                           "response_id")
        task = self._background.get(response_id)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        entry = self.store.get(response_id)
        if entry is None:  # evicted meanwhile
            raise _not_found(response_id, None)
        return entry.response

    # ------------------------------------------------------------------ create
    async def create(self, req: ResponsesRequest) -> dict | AsyncIterator[str]:
        if req.background:
            if req.store is False:
                raise APIError("background responses must be stored (store=true)", 400, "store")
            if req.stream:
                raise APIError("background responses are not streamed here: poll GET "
                               "/v1/responses/{id}", 400, "stream")
        conversation: list[dict] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            conversation = list(prev.conversation)
        conversation += input_messages(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions
                    else []) + conversation
        tools, choice = chat_tools(req)
        body = {"model": req.model, "messages": messages, "temperature": req.temperature,
                "top_p": req.top_p, "max_completion_tokens": req.max_output_tokens,
                "tools": tools, "tool_choice": choice,
                "parallel_tool_calls": req.parallel_tool_calls,
                "response_format": response_format(req), "user": req.user}
        try:
            chat_req = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        run = await self.chat.start(chat_req)
        response_id, created = _id("resp"), time.time()
        if req.background:
            head = self._object(req, response_id, created, "queued", [], None)
            self.store.put(response_id, head, conversation)
            task = asyncio.create_task(self._run_background(req, response_id, created, run, conversation))
            self._background[response_id] = task
            task.add_done_callback(lambda _t: self._background.pop(response_id, None))
            return head
        if req.stream:
            return self._stream(req, response_id, created, run, conversation)
        final = None
        async with aclosing(run.outputs):
            async for _, out in run.outputs:
                final = out
        items = self._items(final, run, _id("msg"))
        return self._finish(req, response_id, created, final, items, conversation)

    async def _run_background(self, req: ResponsesRequest, response_id: str, created: float,
                              run: ChatRun, conversation: list[dict]) -> None:
        """Read a background response's answer and store each state it reaches."""
        def mark(status: str, **fields) -> None:
            if response_id in self._background:  # not deleted meanwhile
                response = {**self._object(req, response_id, created, status, [], None), **fields}
                self.store.put(response_id, response, conversation)

        try:
            final = None
            async with aclosing(run.outputs):  # closing it aborts the engine request
                async for _, out in run.outputs:
                    if final is None:
                        mark("in_progress")
                    final = out
            items = self._items(final, run, _id("msg"))
            if response_id in self._background:
                self._finish(req, response_id, created, final, items, conversation)
        except asyncio.CancelledError:
            mark("cancelled")
        except Exception as e:  # the response fails; the server goes on
            body = _error_body(e)
            mark("failed", error={"code": body.get("code") or "server_error", "message": body["message"]})

    def _items(self, final: RequestOutput, run: ChatRun, message_id: str) -> list[dict]:
        """The answer's output items: its text as a message (unless it is only tool
        calls), then one function_call item per call."""
        o = final.outputs[0]
        message, _ = OpenAIServingChat._message(o, run.parser)
        status = "incomplete" if o.finish_reason == "length" else "completed"
        items = []
        if message.content is not None or not message.tool_calls:
            items.append(_message_item(message_id, message, status))
        for call in message.tool_calls or []:
            items.append({"type": "function_call", "id": _id("fc"), "call_id": call.id,
                          "name": call.function.name, "arguments": call.function.arguments,
                          "status": "completed"})
        return items

    def _finish(self, req: ResponsesRequest, response_id: str, created: float,
                final: RequestOutput, items: list[dict], conversation: list[dict]) -> dict:
        """The finished Response object, stored if asked."""
        prompt = len(final.prompt_token_ids)
        completion = len(final.outputs[0].token_ids)
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                 "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + completion}
        cut = final.outputs[0].finish_reason == "length"
        response = self._object(req, response_id, created, "incomplete" if cut else "completed",
                                items, usage)
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if req.store is not False:
            self.store.put(response_id, response, conversation + output_messages(items))
        return response

    def _object(self, req: ResponsesRequest, response_id: str, created: float, status: str,
                output: list[dict], usage: dict | None) -> dict:
        fmt = text_format(req)
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.chat.model_name,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "store": req.store is not False, "truncation": "disabled",
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
            "background": bool(req.background),
        }

    async def _stream(self, req: ResponsesRequest, response_id: str, created: float,
                      run: ChatRun, conversation: list[dict]) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        message_id = _id("msg")
        head = self._object(req, response_id, created, "in_progress", [], None)
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        state = StreamState(run.parser) if run.parser is not None else None
        opened = False
        sent = 0
        final = None
        try:
            async with aclosing(run.outputs):
                async for _, out in run.outputs:
                    final = out
                    o = out.outputs[0]
                    if state is None:
                        delta, sent = o.text[sent:], max(sent, len(o.text))
                    else:
                        delta = state.update(o.text, final=o.finish_reason is not None).content
                    if not delta:
                        continue
                    if not opened:
                        opened = True
                        yield from_open(event, message_id)
                    yield event("response.output_text.delta", item_id=message_id,
                                output_index=0, content_index=0, delta=delta, logprobs=[])
            items = self._items(final, run, message_id)
            for index, item in enumerate(items):
                if item["type"] == "message":
                    if not opened:
                        yield from_open(event, message_id)
                    part = item["content"][0]
                    yield event("response.output_text.done", item_id=message_id,
                                output_index=index, content_index=0, text=part["text"],
                                logprobs=[])
                    yield event("response.content_part.done", item_id=message_id,
                                output_index=index, content_index=0, part=part)
                else:
                    yield event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
            response = self._finish(req, response_id, created, final, items, conversation)
            kind = ("response.completed" if response["status"] == "completed"
                    else "response.incomplete")
            yield event(kind, response=response)
        except Exception as e:  # the response has begun: the error is its last event
            body = _error_body(e)
            yield event("error", code=body.get("code"), message=body["message"], param=None)


def from_open(event, message_id: str) -> str:
    """The events that open the message item and its one output_text part."""
    item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant",
            "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    return (event("response.output_item.added", output_index=0, item=item)
            + event("response.content_part.added", item_id=message_id, output_index=0,
                    content_index=0, part=part))


def _message_item(message_id: str, message: AssistantMessage, status: str) -> dict:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": message.content or "",
                         "annotations": []}]}


def _error_body(e: Exception) -> dict:
    """OpenAI's error object (`message`, `code`, ...) for an exception raised after a
    response began: a stream's last event, a background response's `error`."""
    err = as_api_error(e)
    return err.body()["error"] if isinstance(err, APIError) else {"message": str(err)}


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(f"Response with id '{response_id[:100]}' not found.", 404, param,
                    "response_not_found")
