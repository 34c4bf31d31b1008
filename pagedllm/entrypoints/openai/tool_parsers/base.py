"""What every tool-call parser shares: a left-to-right JSON scanner, the parsed shape, and
the rule that turns text pieces and calls into one answer.

Streaming and non-streaming answers must agree exactly, so each parser is one function
`parse(text, final)` of the text so far. With `final=False` it returns only what no later
text can change (a possible marker's first characters and an undecided block are held
back); with `final=True` it decides everything. The scanner below makes this hold by
construction: it reads a prefix the way it reads the whole text, stops at the first
character that cannot be JSON, and writes its normalized output character by character, so
the answer for a prefix is always a prefix of the answer for the whole. A stream then only
re-parses the text so far and sends what is new (see chat_output.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
_SCALAR = set("0123456789+-.eEtrufalsn")  # numbers, true, false, null


@dataclass
class ToolCallText:
    """One call: the function's name and its arguments as JSON text (a prefix of it while
    the call is still being written)."""

    name: str
    arguments: str


@dataclass
class ParsedTools:
    content: str
    calls: list[ToolCallText]


@dataclass
class ValueScan:
    norm: str  # the value so far, whitespace outside strings dropped, ", " and ": " separators
    end: int | None  # index after the value; None while it may go on
    ok: bool  # False: a character that cannot be JSON stopped the scan
    start: int = 0  # index of the value's first character


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def scan_value(text: str, i: int) -> ValueScan:
    """One JSON value from `i` (after whitespace). Brackets are matched, strings and their
    escapes followed; scalars end at the first character that cannot continue them."""
    i = skip_ws(text, i)
    start, n = i, len(text)
    out: list[str] = []
    stack: list[str] = []
    in_string = escape = False
    scalar = i < n and text[i] in _SCALAR
    if i < n and not scalar and text[i] not in '"{[':
        return ValueScan("", None, False, start)
    while i < n:
        c = text[i]
        if in_string:
            out.append(c)
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
                if not stack:
                    return ValueScan("".join(out), i + 1, True, start)
        elif scalar:
            if c not in _SCALAR:
                return ValueScan("".join(out), i, True, start)
            out.append(c)
        elif c == '"':
            in_string = True
            out.append(c)
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
            out.append(c)
        elif c in "}]":
            if not stack or stack.pop() != c:
                return ValueScan("".join(out), None, False, start)
            out.append(c)
            if not stack:
                return ValueScan("".join(out), i + 1, True, start)
        elif c in _WS:
            pass
        elif c == ",":
            out.append(", ")
        elif c == ":":
            out.append(": ")
        elif c in _SCALAR and stack:
            out.append(c)
        else:
            return ValueScan("".join(out), None, False, start)
        i += 1
    return ValueScan("".join(out), None, True, start)


@dataclass
class CallScan:
    """A call object scanned so far: `{"name": ..., "arguments": {...}}` (or "parameters")."""

    name: str | None
    args: str | None  # normalized JSON text of the arguments so far
    end: int | None  # index after the closing brace; None while open or broken
    ok: bool
    start: int

    def call(self, closed: bool) -> ToolCallText:
        """The call as sent: arguments "{}" when a finished object had none."""
        args = self.args
        if args is None:
            args = "{}" if closed or self.end is not None or not self.ok else ""
        return ToolCallText(self.name or "", args)


NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")


def scan_call(text: str, i: int) -> CallScan:
    """A call object from `i`: its first string "name" and its first "arguments" (or
    "parameters"). Arguments given as a JSON string are taken, decoded, once complete."""
    i = skip_ws(text, i)
    start, n = i, len(text)
    scan = CallScan(None, None, None, True, start)
    if i >= n:
        return scan
    if text[i] != "{":
        scan.ok = False
        return scan
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= n:
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] == ",":
            i += 1
            continue
        key = scan_value(text, i)
        if not key.ok or not key.norm.startswith('"'):
            scan.ok = False
            return scan
        if key.end is None:
            return scan
        i = skip_ws(text, key.end)
        if i >= n:
            return scan
        if text[i] != ":":
            scan.ok = False
            return scan
        value = scan_value(text, i + 1)
        name = json.loads(text[key.start:key.end])
        is_string = value.norm.startswith('"')
        if name in NAME_KEYS and scan.name is None and is_string and value.end is not None:
            scan.name = json.loads(text[value.start:value.end])
        elif name in ARG_KEYS and scan.args is None:
            if not is_string:
                scan.args = value.norm
            elif value.end is not None:  # arguments already encoded as a string
                decoded = json.loads(text[value.start:value.end])
                scan.args = decoded if isinstance(decoded, str) else json.dumps(decoded)
        if not value.ok:
            scan.ok = False
            return scan
        if value.end is None:
            return scan
        i = value.end


def scan_call_list(text: str, i: int, sep: str, close: str | None, final: bool
                   ) -> tuple[list[CallScan], int | None]:
    """Call objects from `i` separated by `sep` and ended by `close` (if any): the named
    ones, and where the text that is not calls begins (None: not known yet, the text may
    still go on as calls). An object without a name ends the list; its text is not a call."""
    calls: list[CallScan] = []
    n = len(text)
    while True:
        scan = scan_call(text, i)
        if scan.name is None:
            if scan.ok and scan.end is None and not final:
                return calls, None  # it may still get a name
            return calls, skip_ws(text, i) if calls else i
        calls.append(scan)
        if scan.end is None:  # open (truncated) or broken after its name: the rest is its own
            return calls, n if (final or not scan.ok) else None
        i = skip_ws(text, scan.end)
        if i >= n:
            return calls, n if final else None
        if close is not None and text[i] == close:
            return calls, i + 1
        if text[i] != sep:
            return calls, i
        i = skip_ws(text, i + 1)
        if i >= n:
            return calls, n if final else None
        if text[i] != "{":
            return calls, i


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def find_marker(text: str, marker: str, pos: int, final: bool,
                items: list[str | ToolCallText]) -> int:
    """Where `marker` next starts at or after `pos` (-1: nowhere). The text before it goes
    to `items`; with no marker, the rest of the text does, less (until the answer is final)
    a tail that may be the marker's beginning."""
    s = text.find(marker, pos)
    if s < 0:
        rest = text[pos:]
        items.append(rest if final else rest[:len(rest) - partial_marker(rest, marker)])
    else:
        items.append(text[pos:s])
    return s


def list_calls(text: str, scans: list[CallScan], rest: int | None, final: bool) -> ParsedTools:
    """The answer of a call list: its calls, then the text after it (`rest`: where that
    starts; None while the list is still open)."""
    if not scans:  # nothing named yet: text once the list is known not to be calls
        return ParsedTools(text if rest is not None else "", [])
    items: list[str | ToolCallText] = [s.call(final) for s in scans]
    if rest is not None:
        items.append(text[rest:])
    return assemble(items, final)


def assemble(items: list[str | ToolCallText], final: bool) -> ParsedTools:
    """Text pieces and calls in order -> content and calls. Whitespace that only separates
    text from a call is dropped. While not `final`, trailing whitespace waits: a call may
    follow it."""
    merged: list[str | ToolCallText] = []
    for item in items:
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        elif not (isinstance(item, str) and not item):
            merged.append(item)
    parts: list[str] = []
    calls: list[ToolCallText] = []
    for k, item in enumerate(merged):
        if isinstance(item, ToolCallText):
            calls.append(item)
            continue
        if k > 0:
            item = item.lstrip()
        if k + 1 < len(merged) or not final:
            item = item.rstrip()
        parts.append(item)
    return ParsedTools("".join(parts), calls)


class ToolParser:
    """A model family's way of writing tool calls in free text (tool_choice "auto")."""

    name = ""
    # Whether its markers are special tokens, so the text must keep special tokens.
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedTools:
        raise NotImplementedError
