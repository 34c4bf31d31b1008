"""Constrained decoding on the real model (SmolLM2-135M-Instruct, CPU): every answer obeys
its constraint (checked by json.loads + jsonschema, re.fullmatch, membership), sequences
without one are untouched by those beside them, and a bad constraint is refused, naming
its field, before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams as SO
from pagedllm.structured_output import compiler as compiler_mod
from pagedllm.structured_output import compiler_for
from pagedllm.structured_output.source import choice_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        # Bounds no model would pick unprompted: only the mask keeps the answer inside.
        "score": {"type": "integer", "minimum": -7, "maximum": -3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "score", "address"],
}
PALETTE = {
    "type": "object",
    "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                   "minItems": 2, "maxItems": 3},
        "mood": {"type": "string", "enum": ["calm", "angry"]},
        "ok": {"type": "boolean"},
    },
    "required": ["colors", "mood", "ok"],
}


def chat(llm: LLM, text: str, params: SamplingParams):
    return llm.chat([{"role": "user", "content": text}], params)[0]


def greedy(so: SO, max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so, **kw)


def live_matchers(llm: LLM) -> int:
    g = llm.engine.core._grammars
    return 0 if g is None else len(g)


@pytest.fixture(scope="module")
def tight_async_llm():
    """Async scheduling on, and a pool of 6 blocks of 16 tokens: four sequences of ~40
    tokens cannot all stay, so some are preempted and recomputed mid-constraint."""
    return LLM(max_model_len=96, seed=0, async_scheduling=True, block_size=16,
               num_kv_blocks=6, max_num_batched_tokens=96)


@pytest.mark.parametrize("schema", [PERSON, PALETTE], ids=["nested-bounds", "arrays-enums"])
def test_json_schema_answers_validate(smol_llm, schema):
    out = chat(smol_llm, "Make up an example record as JSON.",
               greedy(SO(json=schema, disable_any_whitespace=True), max_tokens=64)).outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
    assert live_matchers(smol_llm) == 0  # freed with the finished sequence


def test_schema_as_text_is_the_same_constraint(smol_llm):
    """A schema given as its JSON text (other spacing) compiles to the same cached grammar."""
    c = compiler_for(smol_llm.get_tokenizer(), smol_llm.engine.executor.vocab_size)
    assert c.compile(SO(json=PALETTE)) is c.compile(SO(json=json.dumps(PALETTE, indent=2)))


def test_regex_answer_fullmatches(smol_llm):
    pattern = r"[A-Z]{2}-\d{3}-[a-z]{2,4}"
    out = smol_llm.generate(["Write a product code:"], greedy(SO(regex=pattern)))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert re.fullmatch(pattern, out.text), out.text


def test_choice_answer_is_one_of_them(smol_llm):
    choices = ["Paris", "London", "Rome"]
    out = chat(smol_llm, "What is the capital of Italy?", greedy(SO(choice=choices))).outputs[0]
    assert out.text in choices and out.finish_reason == "stop"


def test_choice_strings_are_escaped(smol_llm):
    """Quotes, backslashes, line breaks, non-ASCII and astral characters in a choice match
    literally, and nothing else does (checked on the matcher, without sampling)."""
    import xgrammar

    choices = ['say "hi"', "back\\slash", "two\nlines", "peut-être 🚀", "tab\there", ""]
    c = compiler_for(smol_llm.get_tokenizer(), smol_llm.engine.executor.vocab_size)
    compiled = c.compile(SO(choice=choices))
    for s in choices:
        m = xgrammar.GrammarMatcher(compiled)
        assert m.accept_string(s) and m.is_completed(), s
    for s in ["say hi", 'say \\"hi\\"', "back\\\\slash", "two\\nlines", "peut-etre"]:
        m = xgrammar.GrammarMatcher(compiled)
        assert not (m.accept_string(s) and m.is_completed()), s
    assert choice_grammar(["a", "a", "b"]) == 'root ::= "a" | "b"'


def test_ebnf_grammar_answer_parses(smol_llm):
    grammar = r"""
root ::= subject " " verb " " object "."
subject ::= "The cat" | "A dog" | "My friend"
verb ::= "likes" | "sees" | "eats"
object ::= "fish" | "the ball" | "apples"
"""
    parse = re.compile(r"(The cat|A dog|My friend) (likes|sees|eats) (fish|the ball|apples)\.")
    out = smol_llm.generate(["Write one short sentence:"], greedy(SO(grammar=grammar)))[0].outputs[0]
    assert out.finish_reason == "stop" and parse.fullmatch(out.text), out.text


def test_json_object_answer_is_an_object(smol_llm):
    out = chat(smol_llm, 'Reply with the JSON object {"answer": 42} and nothing else.',
               greedy(SO(json_object=True, disable_any_whitespace=True), max_tokens=64)).outputs[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_n2_sampled_answers_each_valid(smol_llm):
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=48,
                            structured_outputs=SO(json=PALETTE, disable_any_whitespace=True))
    outs = chat(smol_llm, "Describe a painting as JSON.", params).outputs
    assert len(outs) == 2
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PALETTE)
    assert live_matchers(smol_llm) == 0


def test_a_complete_grammar_ends_the_sequence_even_with_ignore_eos(smol_llm):
    """The core ends a sequence whose grammar took its end token: ignore_eos cannot make a
    constrained answer run on past it."""
    out = smol_llm.generate(["Answer:"], greedy(SO(choice=["yes", "no"]), ignore_eos=True))[0]
    o = out.outputs[0]
    assert o.text in ("yes", "no") and o.finish_reason == "stop"


def test_stop_string_abort_frees_the_matcher(smol_llm):
    out = chat(smol_llm, "Describe a painting as JSON.",
               greedy(SO(json=PALETTE, disable_any_whitespace=True), stop=["colors"])).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "colors"
    assert live_matchers(smol_llm) == 0


def _mixed_batch_leaves_free_rows_alone(llm: LLM) -> None:
    free = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    free_params = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, free_params)]
    prompts = [free[0], "Write a code:", free[1], "Describe a painting as JSON.", free[2]]
    params = [free_params, greedy(SO(regex=r"[A-Z]{3}\d{2}")), free_params,
              greedy(SO(json=PALETTE, disable_any_whitespace=True)), free_params]
    outs = llm.generate(prompts, params)
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    assert re.fullmatch(r"[A-Z]{3}\d{2}", outs[1].outputs[0].text)
    jsonschema.validate(json.loads(outs[3].outputs[0].text), PALETTE)


def test_mixed_batch_leaves_free_rows_alone(smol_llm):
    _mixed_batch_leaves_free_rows_alone(smol_llm)


def test_mixed_batch_under_async_scheduling():
    """The overlap is turned off while a constrained sequence runs; free sequences give
    the same tokens either way."""
    llm = LLM(max_model_len=512, seed=0, async_scheduling=True)
    assert llm.engine.async_scheduling
    _mixed_batch_leaves_free_rows_alone(llm)
    assert live_matchers(llm) == 0


def test_preempted_constrained_sequences_stay_valid(tight_async_llm):
    llm = tight_async_llm
    before = llm.engine.stats().num_preemptions
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=40,
                            structured_outputs=SO(json=PALETTE, disable_any_whitespace=True))
    outs = llm.generate(["A painting as JSON:"], params)[0].outputs
    assert llm.engine.stats().num_preemptions > before  # the path under test was taken
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PALETTE)
    assert live_matchers(llm) == 0 and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("so, field, why", [
    (SO(json={"type": "nope"}), "json", "Unsupported type"),
    (SO(json='{"type": "object",'), "json", "not valid JSON"),
    (SO(json={"$ref": "#/$defs/missing"}), "json", "missing"),
    (SO(regex="a(b"), "regex", "parenthesis"),
    (SO(grammar='root ::= undefined_rule'), "grammar", "undefined_rule"),
    (SO(grammar='root ::= "unterminated'), "grammar", "string"),
])
def test_bad_constraint_is_refused_before_anything_runs(smol_llm, so, field, why):
    engine = smol_llm.engine
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field}\b.*{re.escape(why)}"):
        smol_llm.generate(["Hi"], greedy(so))
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert live_matchers(smol_llm) == 0
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field}"):  # cached: same answer
        smol_llm.generate(["Hi"], greedy(so))


def test_compile_timeout_is_a_value_error(smol_llm, monkeypatch):
    monkeypatch.setattr(compiler_mod, "COMPILE_TIMEOUT_S", 1e-9)
    # A constraint never compiled before (the cache would answer at once).
    with pytest.raises(ValueError, match=r"structured_outputs\.regex took longer than"):
        smol_llm.generate(["Hi"], greedy(SO(regex=r"timeout-[0-9]{7}-x")))
    assert not smol_llm.engine.scheduler.requests


def test_a_slow_compile_holds_up_no_one(smol_llm, monkeypatch):
    """The core queues a constrained sequence only once its grammar has compiled; until
    then the others step on (a compile is seconds at worst, a step milliseconds)."""
    import threading
    import time

    from pagedllm.engine.messages import EngineCoreRequest
    from pagedllm.structured_output import GrammarCompiler

    gate = threading.Event()
    compile_now = GrammarCompiler._compile_now

    def held(self, src):
        gate.wait(60)
        return compile_now(self, src)

    monkeypatch.setattr(GrammarCompiler, "_compile_now", held)
    engine = smol_llm.engine
    core, eos = engine.core, list(engine.eos_token_ids)
    ids = engine.tokenizer.encode("Write a code:")
    regex = r"held-[0-9]{3}"  # never compiled before: the cache cannot answer
    core.add_request(EngineCoreRequest("held", ids, greedy(SO(regex=regex), max_tokens=16), eos,
                                       time.monotonic()))
    core.add_request(EngineCoreRequest("free", ids, SamplingParams(temperature=0, max_tokens=6,
                                                                   ignore_eos=True), eos,
                                       time.monotonic()))
    tokens: dict[str, list[int]] = {"held": [], "free": []}
    done: set[str] = set()
    while "free" not in done:
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason:
                done.add(o.request_id)
    assert len(tokens["free"]) == 6 and tokens["held"] == []  # it ran while "held" waited
    assert core.has_unfinished_requests()
    gate.set()
    deadline = time.monotonic() + 60
    while "held" not in done and time.monotonic() < deadline:
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason:
                assert o.error is None, o.error
                done.add(o.request_id)
    text = engine.tokenizer.decode(tokens["held"], skip_special_tokens=True)
    assert re.fullmatch(regex, text), text
    assert not core.has_unfinished_requests() and live_matchers(smol_llm) == 0


def test_core_in_its_own_process_compiles_with_its_own_tokenizer():
    """The server's layout: the core process loads the tokenizer when the first constrained
    request arrives and enforces the constraint the front end validated."""
    import asyncio

    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_engine import AsyncLLM

    engine = AsyncLLM(EngineConfig(max_model_len=256, seed=0), in_process=False)
    try:
        assert engine.core is None  # not reachable from here: the test is about the other side

        async def run(params: SamplingParams):
            last = None
            async for out in engine.generate("r", "Write a product code:", None, params):
                last = out
            return last.outputs[0]

        o = asyncio.run(run(greedy(SO(regex=r"[A-Z]{2}-\d{3}"))))
        assert o.finish_reason == "stop" and re.fullmatch(r"[A-Z]{2}-\d{3}", o.text), o.text
        with pytest.raises(ValueError, match=r"structured_outputs\.regex does not compile"):
            asyncio.run(run(greedy(SO(regex="(("))))
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_constrained_request_on_cuda_with_graphs(tmp_path):
    """bf16 on CUDA with decode steps replayed from graphs and the split (overlapped) step:
    a random-weight llama with a byte-level tokenizer (the real model is too big to carry
    to the lent GPU), so only the mask can make its answer valid JSON."""
    from pagedllm.entrypoints.bench_workloads import (
        LLAMA2_7B_CONFIG,
        write_arch_config,
        write_byte_tokenizer,
    )

    config = dict(LLAMA2_7B_CONFIG, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=1024)
    path = write_arch_config(config, str(tmp_path))
    write_byte_tokenizer(path, config["vocab_size"])
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", max_model_len=512, seed=0,
              device="cuda", async_scheduling=True)
    assert llm.engine.executor.runner.graphs is not None  # decode steps replay graphs
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], free)[0].outputs[0].token_ids
    outs = llm.generate(["The capital of France is", "A painting as JSON:"],
                        [free, greedy(SO(json=PALETTE, disable_any_whitespace=True), max_tokens=128)])
    assert outs[0].outputs[0].token_ids == alone
    o = outs[1].outputs[0]
    assert o.finish_reason == "stop", o.text
    jsonschema.validate(json.loads(o.text), PALETTE)
