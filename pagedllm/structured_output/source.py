"""A request's constraint as grammar source text: what gets compiled, and the cache key.

Each constraint kind becomes one (kind, text) pair in a canonical spelling, so that the
same constraint written two ways (a schema as a dict or as its text, with other spacing)
is compiled once. `choice` has no compiler of its own: it is turned into an EBNF grammar
of its alternatives here, each string escaped so that quotes, backslashes, newlines and
non-ASCII text in a choice match literally.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedllm.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSource:
    """What to compile. `field` is the StructuredOutputsParams field it came from, named
    in every error so a client knows which part of the request to fix."""

    kind: str  # "json" | "json_object" | "regex" | "grammar"
    text: str
    any_whitespace: bool
    field: str

    @property
    def key(self) -> tuple[str, str, bool]:
        return (self.kind, self.text, self.any_whitespace)


def ebnf_string_literal(s: str) -> str:
    """`s` as a double-quoted EBNF (GBNF) literal that matches exactly `s`.

    Printable characters stand for themselves except the quote and the backslash; every
    other character (controls, line breaks, unassigned or invisible code points) is
    written as a \\u or \\U escape, which the grammar parser reads back as that code point.
    """
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings (duplicates dropped,
    order kept: it does not change what matches, only the text of the cache key)."""
    unique = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(ebnf_string_literal(c) for c in unique)


def canonical_schema(schema: str | dict) -> str:
    """The schema's JSON text with fixed spacing. Key order is kept on purpose: the
    compiled grammar writes an object's properties in the order the schema lists them."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON Schema object, got "
                         f"{type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json cannot be written as JSON: {e}") from None


def grammar_source(params: StructuredOutputsParams) -> GrammarSource:
    """The canonical source of one constraint; ValueError for one that is malformed before
    it reaches the compiler (a schema that is not JSON)."""
    any_ws = not params.disable_any_whitespace
    kind = params.kind
    if kind == "json":
        return GrammarSource("json", canonical_schema(params.json), any_ws, "json")
    if kind == "json_object":
        return GrammarSource("json_object", "", any_ws, "json_object")
    if kind == "regex":
        return GrammarSource("regex", params.regex, True, "regex")
    if kind == "choice":
        return GrammarSource("grammar", choice_grammar(params.choice), True, "choice")
    return GrammarSource("grammar", params.grammar, True, "grammar")
