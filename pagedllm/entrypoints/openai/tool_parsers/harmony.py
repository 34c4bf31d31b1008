"""gpt-oss (harmony) tool calls: a message addressed to a function,
`<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`
(`to=` may also stand before the channel). Its arguments are the message's body; the other
messages' bodies are the content. It reads the raw answer, or the content the harmony
reasoning parser leaves (which passes calls on in this same form)."""

from __future__ import annotations

from ..harmony import harmony_messages
from .base import ParsedTools, ToolCallText, ToolParser, assemble

FUNCTIONS = "functions."


class HarmonyToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> ParsedTools:
        items: list[str | ToolCallText] = []
        for msg in harmony_messages(text, final):
            if msg.recipient is None or not msg.recipient.startswith(FUNCTIONS):
                items.append(msg.body)
                continue
            args = msg.body.lstrip()  # as the model wrote them (harmony constrains them to JSON)
            items.append(ToolCallText(msg.recipient[len(FUNCTIONS):], args or ("{}" if msg.complete else "")))
        return assemble(items, final)
