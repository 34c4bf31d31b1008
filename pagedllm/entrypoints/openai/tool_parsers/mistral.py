"""Mistral calls after the `[TOOL_CALLS]` token: a JSON list of call objects (older
tokenizers, `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`) or, from tokenizer v11 on,
`[TOOL_CALLS]name[ARGS]{...}` once per call. Text before the first marker is content."""

from __future__ import annotations

from .base import (
    ParsedTools,
    ToolCallText,
    ToolParser,
    assemble,
    find_marker,
    scan_call_list,
    scan_value,
    skip_ws,
)


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> ParsedTools:
        items: list[str | ToolCallText] = []
        pos = 0
        while True:
            s = find_marker(text, self.START, pos, final, items)
            if s < 0:
                break
            calls, rest = self._calls(text, s + len(self.START), final)
            if not calls:  # nothing named: the marker and what follows are text, once known
                if rest is not None:
                    items.append(text[s:])
                break
            items.extend(calls)
            if rest is None:
                break
            pos = rest
        return assemble(items, final)

    def _calls(self, text: str, i: int, final: bool) -> tuple[list[ToolCallText], int | None]:
        """The calls after one marker, and where what follows them begins (None: unknown yet)."""
        i = skip_ws(text, i)
        if i >= len(text):
            return [], len(text) if final else None
        if text[i] == "[":
            scans, rest = scan_call_list(text, i + 1, ",", "]", final)
            return [c.call(final) for c in scans], rest
        a = text.find(self.ARGS, i)
        if a < 0:
            return [], len(text) if final else None
        name = text[i:a].strip()
        if not name or any(c.isspace() for c in name):
            return [], len(text)
        value = scan_value(text, a + len(self.ARGS))
        args = value.norm
        if value.end is None and (final or not value.ok) and not args:
            args = "{}"
        rest = value.end if value.end is not None else (len(text) if final or not value.ok else None)
        return [ToolCallText(name, args)], rest
