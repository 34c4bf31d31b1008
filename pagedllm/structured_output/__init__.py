"""Constrained decoding (JSON Schema, JSON object, regex, choice, EBNF grammar) with
xgrammar: constraints compiled per tokenizer and cached (compiler, source), one matcher
per sequence in the engine core (matchers), a token bitmask applied to the logits before
sampling (bitmask). torch and xgrammar are imported only where a constraint is used."""

from pagedllm.structured_output.compiler import (
    GrammarCompiler,
    compiler_for,
    validate_structured_outputs,
)
from pagedllm.structured_output.matchers import SequenceGrammars, StepBitmask
from pagedllm.structured_output.source import GrammarSource, choice_grammar, grammar_source

__all__ = ["GrammarCompiler", "GrammarSource", "SequenceGrammars", "StepBitmask",
           "choice_grammar", "compiler_for", "grammar_source", "validate_structured_outputs"]
