"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3 templates): each call is a JSON object
between `<tool_call>` and `</tool_call>`; text around the blocks is the message content."""

from __future__ import annotations

from .base import (
    ParsedTools,
    ToolCallText,
    ToolParser,
    assemble,
    find_marker,
    partial_marker,
    scan_call,
)


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedTools:
        items: list[str | ToolCallText] = []
        pos = 0
        while True:
            s = find_marker(text, self.START, pos, final, items)
            if s < 0:
                break
            body_start = s + len(self.START)
            e = text.find(self.END, body_start)
            closed = e >= 0 or final
            body = text[body_start:e] if e >= 0 else text[body_start:]
            if e < 0 and not final:
                body = body[:len(body) - partial_marker(body, self.END)]
            scan = scan_call(body, 0)
            if scan.name is not None:
                items.append(scan.call(closed))
            elif closed:  # not a call after all: the block is text
                items.append(text[s:e + len(self.END)] if e >= 0 else text[s:])
            if e < 0:
                break
            pos = e + len(self.END)
        return assemble(items, final)
