"""Constraints -> xgrammar CompiledGrammars: one compiler per tokenizer, a content cache,
a deadline on every compile, and errors that name the request field at fault.

Both sides of the engine compile: the front end to refuse a bad constraint before anything
is queued (`validate_structured_outputs`), the core to build each sequence's matcher. They
share one `GrammarCompiler` per tokenizer object (`compiler_for`), so in-process (the
offline `LLM`) a constraint is compiled once; a core in a process of its own compiles it
again from the same text, which is as fast as it was for the front end.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.source import GrammarSource, grammar_source

# A compile that takes longer is refused: a schema or grammar crafted to explode (deeply
# nested, huge repetition counts) must not stall the engine. Module-level so tests and
# operators can change it.
COMPILE_TIMEOUT_S = 30.0
CACHE_SIZE = 256  # compiled constraints kept per tokenizer (least recently used dropped)

# xgrammar prefixes its errors with "[time] /path/file.cc:line: ": internals, not news.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_WHAT = {"json": "is not a JSON Schema the engine can enforce",
         "json_object": "cannot be compiled",
         "regex": "does not compile",
         "choice": "does not compile",
         "grammar": "is not a valid EBNF grammar"}


def _clean(e: BaseException) -> str:
    lines = [_LOCATION.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__


class GrammarCompiler:
    """Compiles constraints for one tokenizer (and one model vocabulary: masks have the
    width of the model's logits, which may exceed the tokenizer's vocabulary).

    Thread-safe: the server's front end and the core thread may compile at once. A second
    request for a constraint that is still compiling waits for that compile instead of
    starting another, so a slow constraint sent many times costs one compile."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE):
        import xgrammar

        try:
            self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size)
        except Exception as e:
            raise ValueError("structured_outputs needs a Hugging Face tokenizer; this model's "
                             f"tokenizer cannot be used: {_clean(e)}") from None
        self.vocab_size = vocab_size
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache_size = cache_size
        # key -> CompiledGrammar, or the ValueError its source gave (a bad constraint sent
        # again fails at once). A timeout is not kept: the next try may run on an idle host.
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._running: dict[tuple, Future] = {}
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> tuple[GrammarSource, Future]:
        """Start compiling a constraint (or find it compiled or compiling): its source and
        a future of the CompiledGrammar or the ValueError its source gave. The engine core
        takes this route so that no compile ever holds up a step."""
        src = grammar_source(params)
        with self._lock:
            hit = self._cache.get(src.key)
            if hit is not None:
                self._cache.move_to_end(src.key)
                fut: Future = Future()
                fut.set_result(hit)
                return src, fut
            fut = self._running.get(src.key)
            if fut is None:
                fut = self._running[src.key] = Future()
                # A daemon thread: a compile past its deadline cannot be stopped, but it
                # must not keep the interpreter from exiting either.
                threading.Thread(target=self._run, args=(src, fut), daemon=True,
                                 name="pagedllm-grammar-compile").start()
        return src, fut

    @staticmethod
    def timeout_error(src: GrammarSource, timeout_s: float) -> ValueError:
        return ValueError(f"structured_outputs.{src.field} took longer than {timeout_s:g} s "
                          "to compile; simplify the constraint")

    @staticmethod
    def outcome(result: Any):
        """A finished compile's CompiledGrammar; its ValueError raised."""
        if isinstance(result, ValueError):
            raise ValueError(str(result))
        return result

    def compile(self, params: StructuredOutputsParams, timeout_s: float | None = None):
        """The CompiledGrammar of a constraint; ValueError naming the field when it is
        malformed, unsupported or does not compile within the deadline. Blocks the caller:
        the front end calls it off its event loop."""
        timeout = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
        src, fut = self.submit(params)
        try:
            result = fut.result(timeout=timeout)
        except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
            raise self.timeout_error(src, timeout) from None
        return self.outcome(result)

    def _run(self, src: GrammarSource, fut: Future) -> None:
        try:
            result: Any = self._compile_now(src)
        except Exception as e:
            result = ValueError(f"structured_outputs.{src.field} {_WHAT[src.field]}: {_clean(e)}")
        with self._lock:
            self._running.pop(src.key, None)
            self._cache[src.key] = result
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        fut.set_result(result)

    def _compile_now(self, src: GrammarSource):
        c = self._compiler
        if src.kind == "json":
            return c.compile_json_schema(src.text, any_whitespace=src.any_whitespace)
        if src.kind == "json_object":
            # Any object (with any keys): the schema {"type": "object"} without strict
            # mode. The builtin JSON grammar would also allow a top-level array.
            return c.compile_json_schema('{"type":"object"}', any_whitespace=src.any_whitespace,
                                         strict_mode=False)
        if src.kind == "regex":
            return c.compile_regex(src.text)
        return c.compile_grammar(src.text)


_compilers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_strong: dict[int, tuple[Any, dict]] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The compiler shared by everyone holding this tokenizer object (built on first use:
    reading the vocabulary takes a moment, which requests without constraints never pay)."""
    if tokenizer is None:
        raise ValueError("structured_outputs needs the tokenizer (skip_tokenizer_init=False)")
    with _compilers_lock:
        try:
            per_vocab = _compilers.setdefault(tokenizer, {})
        except TypeError:  # not weakly referenceable: held (and keyed) by its id instead
            per_vocab = _strong.setdefault(id(tokenizer), (tokenizer, {}))[1]
        compiler = per_vocab.get(vocab_size)
        if compiler is None:
            compiler = per_vocab[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


def validate_structured_outputs(params: SamplingParams | StructuredOutputsParams | None,
                                tokenizer: Any, vocab_size: int) -> None:
    """ValueError (naming the field) for a constraint that cannot be enforced; nothing for
    a request without one. Compiles it, so the core's compile of it is then a cache hit
    when the core shares this process."""
    so = params.structured_outputs if isinstance(params, SamplingParams) else params
    if so is None:
        return
    compiler_for(tokenizer, vocab_size).compile(so)
