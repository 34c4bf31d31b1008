"""The answer of a request whose tool_choice is "required" or a named function: the engine
holds the output to a JSON list of `{"name": ..., "arguments": {...}}` objects (the schema
comes from tools.py), which becomes the message's tool calls. Output that is not such a list
(no grammar enforced it) stays content."""

from __future__ import annotations

from .base import (
    ParsedTools,
    ToolParser,
    assemble,
    list_calls,
    scan_call_list,
    skip_ws,
)


class ForcedToolParser(ToolParser):
    name = "forced"

    def parse(self, text: str, final: bool) -> ParsedTools:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParsedTools(text if final else "", [])
        if text[i] != "[":
            return assemble([text], final)
        scans, rest = scan_call_list(text, i + 1, ",", "]", final)
        return list_calls(text, scans, rest, final)
