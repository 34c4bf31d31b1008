"""The hand-built stream events are byte for byte what the response models would write.

Most events of a stream (text, no logprobs) are written from plain dicts by msgspec rather
than built and dumped as pydantic models; clients must not be able to tell."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.serving_engine import sse, sse_plain

TEXTS = ["", "plain", ' "quoted" and \\ backslash', "tab\tnew\nline\r\x00\x1f\x7f",
         "héllo wörld 日本語 🎉", "\u2028\u2029 line separators", "</script>"]
ENDINGS = [(None, None), ("length", None), ("stop", 2), ("stop", "###"), ("abort", None)]
HEAD = {"id": "cmpl-0123", "created": 1796479871, "model": "m\u00f6del/\"x\""}


def _head(kind: str) -> dict:
    """The first keys in the order the endpoints write them (the models' field order)."""
    return {"id": HEAD["id"], "object": kind, "created": HEAD["created"], "model": HEAD["model"]}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", ENDINGS)
def test_completion_chunk(text, finish, stop):
    model = CompletionResponse(**HEAD, choices=[CompletionChoice(
        index=3, text=text, finish_reason=finish, stop_reason=stop)])
    plain = sse_plain({**_head("text_completion"), "choices": [{
        "index": 3, "text": text, "logprobs": None, "finish_reason": finish,
        "stop_reason": stop}], "usage": None})
    assert plain == sse(model).encode()


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", ENDINGS)
def test_chat_chunk(text, finish, stop):
    head = _head("chat.completion.chunk")
    for delta, plain_delta in ((DeltaMessage(role="assistant", content=""),
                                {"role": "assistant", "content": ""}),
                               (DeltaMessage(content=text) if text else DeltaMessage(),
                                {"content": text} if text else {})):
        model = ChatCompletionChunk(**HEAD, choices=[ChatStreamChoice(
            index=1, delta=delta, finish_reason=finish, stop_reason=stop)])
        plain = sse_plain({**head, "choices": [{
            "index": 1, "delta": plain_delta, "logprobs": None, "finish_reason": finish,
            "stop_reason": stop}], "usage": None})
        assert plain == sse(model).encode()
