"""Llama 3.1/3.2/3.3 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`,
possibly after `<|python_tag|>` and possibly several joined by `;`. An answer that does not
open with such an object is plain content."""

from __future__ import annotations

from .base import (
    ParsedTools,
    ToolParser,
    assemble,
    list_calls,
    scan_call_list,
    skip_ws,
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedTools:
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        elif not final and self.TAG.startswith(text[i:]):
            return ParsedTools("", [])  # the tag, or nothing yet
        if i >= len(text):
            return ParsedTools(text if final else "", [])
        if text[i] != "{":
            return assemble([text], final)
        scans, rest = scan_call_list(text, i, ";", None, final)
        return list_calls(text, scans, rest, final)
