"""Reasoning parsers (`--reasoning-parser`): the text a thinking model writes between
`<think>` and `</think>` is the message's `reasoning_content`, the rest its `content` (and
what tool parsing reads).

Like the tool parsers, `parse(text, final)` sees the text so far: while not final it holds
back what could still be the start of a tag, so the parse of a prefix is always a prefix of
the parse of the whole, and a stream that re-parses and sends the difference ends with
exactly the non-streaming answer. Text after `</think>` loses its leading whitespace (the
newlines the templates put there).

gpt-oss writes the harmony format instead of tags (HarmonyReasoningParser): messages on the
`analysis` channel are reasoning, those on `final` (and user-visible `commentary` preambles)
content; its markers are special tokens, so the parser asks for them to be kept."""

from __future__ import annotations

from dataclasses import dataclass

from .harmony import CHANNEL, MESSAGE, START, harmony_messages
from .tool_parsers.base import partial_marker

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ParsedReasoning:
    reasoning: str | None  # None: no reasoning in this answer
    content: str


class ReasoningParser:
    name = ""
    keeps_special_tokens = False  # its markers are special tokens the detokenizer must keep

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        raise NotImplementedError


def _held(text: str, marker: str, final: bool) -> str:
    return text if final else text[:len(text) - partial_marker(text, marker)]


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and templates that open `<think>` in the prompt): everything before
    `</think>` is reasoning, whether or not the output repeats the opening tag; an answer
    that never closes it is all reasoning."""

    name = "deepseek_r1"

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        if text.startswith(OPEN):
            text = text[len(OPEN):]
        elif not final and OPEN.startswith(text):
            return ParsedReasoning(None, "")  # maybe the opening tag, maybe not: wait
        e = text.find(CLOSE)
        if e < 0:
            reasoning = _held(text, CLOSE, final)
            return ParsedReasoning(reasoning or None, "")
        return ParsedReasoning(text[:e] or None, text[e + len(CLOSE):].lstrip())


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only inside explicit `<think>`...`</think>` (the first pair); an
    answer without the tag is all content, one cut off inside it is reasoning to the end."""

    name = "qwen3"

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        s = text.find(OPEN)
        if s < 0:
            return ParsedReasoning(None, _held(text, OPEN, final))
        before, rest = text[:s], text[s + len(OPEN):]
        e = rest.find(CLOSE)
        if e < 0:
            return ParsedReasoning(_held(rest, CLOSE, final) or None, before)
        after = rest[e + len(CLOSE):]
        return ParsedReasoning(rest[:e] or None, before + (after.lstrip() if not before else after))


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss (harmony): the `analysis` channel is reasoning; `final` and `commentary`
    messages are content. A tool call (a message with a `to=functions.NAME` recipient) is
    passed on to the content as the message `<|start|>assistant<|channel|>commentary
    to=functions.NAME<|message|>ARGS` (plus `<|call|>` once complete), for the harmony tool
    parser (tool_parsers/harmony.py)."""

    name = "gpt_oss"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedReasoning:
        reasoning, content = [], []
        for msg in harmony_messages(text, final):
            if msg.recipient is not None:
                content.append(f"{START}assistant{CHANNEL}{msg.channel} to={msg.recipient}{MESSAGE}"
                               f"{msg.body}" + ("<|call|>" if msg.complete else ""))
            elif msg.channel == "analysis":
                reasoning.append(msg.body)
            else:
                content.append(msg.body)
        joined = "\n".join(reasoning)
        return ParsedReasoning(joined or None, "".join(content))


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)
}
REASONING_PARSERS["openai_gptoss"] = HarmonyReasoningParser  # vLLM's name for it


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(REASONING_PARSERS)}") from None
