"""A chat answer's text -> reasoning, content and tool calls, whole or as stream deltas.

`OutputParser.parse(text, final)` runs the reasoning parser and then the tool parser on the
content it leaves. Both are written so that the parse of a prefix of the text is a prefix
(field by field: reasoning, content, each call's name and arguments) of the parse of the
whole. `StreamState` builds on that: for every new piece of output it parses the whole
text so far again and sends only what grew, never taking back what it sent. The deltas of
a stream therefore add up to the non-streaming answer exactly, however the text was cut into
pieces (tests cut it at random places and compare)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .reasoning_parsers import ReasoningParser
from .tool_parsers import ToolCallText, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str
    calls: list[ToolCallText]

    @property
    def message_content(self) -> str | None:
        """OpenAI's message content: null for an answer that is only tool calls."""
        return None if self.calls and not self.content else self.content


@dataclass
class OutputParser:
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    single_call: bool = False  # parallel_tool_calls=false: the first call only

    def parse(self, text: str, final: bool) -> ParsedOutput:
        reasoning = None
        if self.reasoning is not None:
            r = self.reasoning.parse(text, final)
            reasoning, text = r.reasoning, r.content
        if self.tools is None:
            return ParsedOutput(reasoning, text, [])
        t = self.tools.parse(text, final)
        calls = t.calls[:1] if self.single_call else t.calls
        return ParsedOutput(reasoning, t.content, calls)


@dataclass
class CallDelta:
    """One stream delta of one call: the first carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict:
        function: dict = {"arguments": self.arguments}
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class StreamDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def to_dict(self) -> dict:
        """The `delta` object of a chunk: only the fields that grew."""
        out: dict = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.calls:
            out["tool_calls"] = [c.to_dict() for c in self.calls]
        return out


@dataclass
class StreamState:
    """What one choice of a stream has sent so far."""

    parser: OutputParser
    reasoning_sent: int = 0
    content_sent: int = 0
    calls_sent: list[tuple[str, int]] = field(default_factory=list)  # (id, argument chars)
    has_calls: bool = False

    def update(self, text: str, final: bool) -> StreamDelta:
        p = self.parser.parse(text, final)
        delta = StreamDelta()
        if p.reasoning and len(p.reasoning) > self.reasoning_sent:
            delta.reasoning = p.reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(p.reasoning)
        if len(p.content) > self.content_sent:
            delta.content = p.content[self.content_sent:]
            self.content_sent = len(p.content)
        for k, call in enumerate(p.calls):
            if k < len(self.calls_sent):
                cid, sent = self.calls_sent[k]
                if len(call.arguments) > sent:
                    delta.calls.append(CallDelta(k, call.arguments[sent:]))
                    self.calls_sent[k] = (cid, len(call.arguments))
            else:
                cid = call_id()
                delta.calls.append(CallDelta(k, call.arguments, cid, call.name))
                self.calls_sent.append((cid, len(call.arguments)))
        self.has_calls = self.has_calls or bool(p.calls)
        return delta
