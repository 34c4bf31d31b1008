"""Tool-call parsers, one module per model family's format, chosen by `--tool-call-parser`."""

from __future__ import annotations

from .base import ParsedTools, ToolCallText, ToolParser
from .forced import ForcedToolParser
from .harmony import HarmonyToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, HarmonyToolParser)
}

__all__ = ["TOOL_PARSERS", "ForcedToolParser", "ParsedTools", "ToolCallText", "ToolParser",
           "get_tool_parser"]


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(TOOL_PARSERS)}") from None
