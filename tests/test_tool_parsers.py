"""Tool-call and reasoning parsers: what each format parses to, and that a stream (the
same output cut into deltas anywhere) always adds up to exactly the non-streaming answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.chat_output import OutputParser, StreamState
from pagedllm.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    get_reasoning_parser,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ForcedToolParser,
    get_tool_parser,
)
from pagedllm.entrypoints.openai.tool_parsers.base import scan_value

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("hermes", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                       ("get_time", '{"tz": "Europe/Paris"}')]),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None, [("f", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"x": [1, 2.5e3, true, null]}, "name": "f"}</tool_call>',
     None, [("f", '{"x": [1, 2.5e3, true, null]}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>', None,
     [("f", '{"s": "a')]),  # the closing tag ends the block, even inside a string
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),
    ("hermes", "a <tool_ca", "a <tool_ca", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
     None, [("a", "{}"), ("b", '{"x": 1}')]),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "a", "parameters": {"q":  "x"}}\n\nDone.', "Done.",
     [("a", '{"q": "x"}')]),
    ("mistral", f"[TOOL_CALLS][{WEATHER}, {TIME}]", None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
     "Sure.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    ("mistral", "No tools needed.", "No tools needed.", []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("forced", f"[{WEATHER}]", None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("forced", '[ {"name" :"a","arguments":{ "k" :[ 1 ,2 ] } } ,\n{"name":"b","arguments":{}}]',
     None, [("a", '{"k": [1, 2]}'), ("b", "{}")]),
    ("forced", "I cannot call tools.", "I cannot call tools.", []),
    # gpt-oss (harmony); without a reasoning parser the analysis channel is content too
    ("openai", '<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary'
     ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', "Need weather.",
     [("get_weather", '{"city": "Paris"}')]),
    ("openai", ' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>', None, [("get_time", "{}")]),
    ("openai", "<|channel|>final<|message|>Paris.<|return|>", "Paris.", []),
    ("openai", "Paris.", "Paris.", []),
]


def parser_for(name: str, reasoning: str | None = None, single: bool = False) -> OutputParser:
    tools = ForcedToolParser() if name == "forced" else get_tool_parser(name) if name else None
    return OutputParser(get_reasoning_parser(reasoning) if reasoning else None, tools, single)


def streamed(parser: OutputParser, text: str, cuts: list[int]) -> tuple[str, str, list[tuple]]:
    """The deltas of `text` cut at `cuts`, added up: (reasoning, content, [(name, args)]),
    checking the shape OpenAI gives call deltas on the way."""
    state = StreamState(parser)
    reasoning = content = ""
    calls: list[list] = []
    ends = sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    for end in ends:
        d = state.update(text[:end], final=end == len(text)).to_dict()
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if c["index"] == len(calls):  # a new call opens with id, type and name
                assert c["id"].startswith("call_") and c["type"] == "function"
                calls.append([c["function"]["name"], c["function"]["arguments"]])
            else:
                assert c["index"] < len(calls) and "id" not in c and "name" not in c["function"]
                calls[c["index"]][1] += c["function"]["arguments"]
    return reasoning, content, [tuple(c) for c in calls]


def whole(parser: OutputParser, text: str) -> tuple[str, str, list[tuple]]:
    p = parser.parse(text, final=True)
    return p.reasoning or "", p.message_content or "", [(c.name, c.arguments) for c in p.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parse_whole_answer(name, text, content, calls):
    p = parser_for(name).parse(text, final=True)
    assert p.message_content == content
    assert [(c.name, c.arguments) for c in p.calls] == calls
    for _, args in calls:
        if args.endswith("}") and args.count("{") == args.count("}"):
            json.loads(args)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_stream_cut_anywhere_equals_whole(name, text, content, calls, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    parser = parser_for(name)
    assert streamed(parser, text, cuts) == whole(parser, text)


def test_every_character_its_own_delta():
    for name, text, *_ in CASES:
        parser = parser_for(name)
        assert streamed(parser, text, list(range(len(text)))) == whole(parser, text), (name, text)


# Pieces of real and broken outputs: markers, their halves, JSON, text, whitespace.
FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "call>", "[TOOL_CALLS]", "[ARGS]", "[TOOL",
             "<|python_tag|>", "<think>", "</think>", "</th", "{", "}", "[", "]", '"name"', '"arguments"',
             '"parameters"', ":", ",", ";", '"f"', '"x\\"y"', "1", "-2.5", "true", "null", "\n", " ",
             "Hello", "a<b", '\\', '"', WEATHER, TIME, "get_weather", "x",
             "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|", "analysis", "final",
             "commentary", " to=functions.f", "to="]


@pytest.mark.parametrize("name", [*TOOL_PARSERS, "forced", ""])
@pytest.mark.parametrize("reasoning", [None, "deepseek_r1", "qwen3", "gpt_oss"])
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_stream_equals_whole_for_any_text(name, reasoning, data):
    """Arbitrary mixtures of markers, JSON and text: whatever the parse is, streaming it
    gives the same."""
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=14)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    parser = parser_for(name, reasoning)
    assert streamed(parser, text, cuts) == whole(parser, text)


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_parallel_tool_calls_false_keeps_the_first_call(name):
    text = (f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>" if name == "hermes"
            else f"[TOOL_CALLS][{WEATHER}, {TIME}]")
    parser = parser_for(name, single=True)
    assert [c.name for c in parser.parse(text, True).calls] == ["get_weather"]
    assert streamed(parser, text, list(range(0, len(text), 3))) == whole(parser, text)


def test_marker_start_is_held_back_not_streamed():
    state = StreamState(parser_for("hermes"))
    assert state.update("Sure <tool", False).content == "Sure"
    d = state.update('Sure <tool_call>{"name": "f", "arguments": {"a"', False)
    assert d.content == "" and d.calls[0].name == "f" and d.calls[0].arguments == '{"a"'
    d = state.update('Sure <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', True)
    assert d.calls[0].arguments == ": 1}" and d.calls[0].id is None and state.has_calls


# ---------------------------------------------------------------------- reasoning
REASONING_CASES = [
    ("deepseek_r1", "<think>Paris is in France.</think>\n\nParis.", "Paris is in France.", "Paris."),
    ("deepseek_r1", "Paris is in France.</think>Paris.", "Paris is in France.", "Paris."),
    ("deepseek_r1", "still thinking when cut off", "still thinking when cut off", ""),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "Paris."),
    ("qwen3", "Paris.", "", "Paris."),
    ("qwen3", "<think>cut off", "cut off", ""),
    ("qwen3", "Paris </thin", "", "Paris </thin"),
    ("gpt_oss", "<|channel|>analysis<|message|>Paris is in France.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Paris.", "Paris is in France.", "Paris."),
    ("gpt_oss", "<|channel|>analysis<|message|>cut off", "cut off", ""),
    ("gpt_oss", "Paris.", "", "Paris."),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split(name, text, reasoning, content):
    p = parser_for("", name).parse(text, final=True)
    assert (p.reasoning or "", p.content) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING_CASES)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_reasoning_stream_cut_anywhere_equals_whole(name, text, reasoning, content, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    parser = parser_for("", name)
    assert streamed(parser, text, cuts) == (reasoning, content, [])


def test_reasoning_then_tool_call():
    text = f"<think>The user wants weather.</think>\n<tool_call>{WEATHER}</tool_call>"
    parser = parser_for("hermes", "qwen3")
    assert whole(parser, text) == ("The user wants weather.", "",
                                   [("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    assert streamed(parser, text, list(range(len(text)))) == whole(parser, text)


def test_harmony_reasoning_then_tool_call():
    text = ('<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant to=functions.'
            'get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    parser = parser_for("openai", "gpt_oss")
    assert whole(parser, text) == ("The user wants weather.", "", [("get_weather", '{"city": "Paris"}')])
    assert streamed(parser, text, list(range(len(text)))) == whole(parser, text)


def test_reasoning_parsers_by_name():
    assert isinstance(get_reasoning_parser("deepseek_r1"), DeepSeekR1ReasoningParser)
    assert isinstance(get_reasoning_parser("qwen3"), Qwen3ReasoningParser)
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


# ---------------------------------------------------------------------- the JSON scanner
@pytest.mark.parametrize("value", [{"a": [1, {"b": None}], "c": "x\"}\\"}, [], "s", 1.5, True,
                                   {"nested": {"deeper": [[[]]]}}])
def test_scanner_normalizes_like_json_dumps(value):
    pretty = json.dumps(value, indent=3)
    scan = scan_value(pretty + " tail", 0)
    assert scan.ok and scan.norm == json.dumps(value)
    assert pretty[: scan.end - 0].strip() == pretty.strip() or isinstance(value, bool | float)


def test_scanner_stops_at_what_cannot_be_json():
    assert not scan_value('{"a": 1 <', 0).ok
    assert not scan_value("{]", 0).ok
    scan = scan_value('{"a": "<b>"', 0)
    assert scan.ok and scan.end is None and scan.norm == '{"a": "<b>"'
