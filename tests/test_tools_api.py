"""The HTTP half of structured outputs and tool calling, in process over a scripted engine:
request fields -> SamplingParams.structured_outputs, the 400s for bad shapes, tools and
earlier calls handed to the chat template, and answers turned into tool calls and
reasoning, streamed and not. (Enforcement is the engine's: tests/test_tools_server.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm.config import default_model_path
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import (
    ChatOptions,
    chat_options,
    make_arg_parser,
    parse_args,
)
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import StructuredOutputsParams

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
# Shows what the template was given: the tools and earlier calls (arguments as dicts).
TEMPLATE = ("{% for t in tools or [] %}TOOL {{ t.function.name }} {{ t.function.parameters.type }}\n"
            "{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}"
            "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }}"
            " city={{ c.function.arguments.city }}{% endfor %}"
            "{% if m.tool_call_id %} ANSWERS {{ m.tool_call_id }}{% endif %}\n{% endfor %}")


class ScriptedEngine:
    """Answers every request with `script` (pieces of text, one output each) and keeps
    the prompts and SamplingParams it was given."""

    max_model_len = 2048
    is_healthy = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.script: list[str] = ["Hello"]
        self.calls: list[tuple[str | None, object]] = []

    async def generate(self, request_id, prompt, prompt_token_ids, params):
        self.calls.append((prompt, params))
        text = ""
        for k, piece in enumerate(self.script):
            text += piece
            last = k == len(self.script) - 1
            outs = [CompletionOutput(i, text, list(range(k + 1)), None, None,
                                     "stop" if last else None) for i in range(params.n)]
            yield RequestOutput(request_id, prompt, list(prompt_token_ids), outs, finished=last)

    @property
    def params(self):
        return self.calls[-1][1]


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.tokenizers import gguf_tokenizer

    return gguf_tokenizer(default_model_path())


def make_client(tokenizer, options: ChatOptions | None = None) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer)
    config = SimpleNamespace(served_model_name=["m"], model_name="m", model="m",
                             generation_config="vllm", max_logprobs=20, runner="generate")
    app = build_app(engine, config, chat_template=TEMPLATE, options=options)
    return TestClient(app), engine


@pytest.fixture(scope="module")
def plain(tokenizer):
    return make_client(tokenizer)


@pytest.fixture(scope="module")
def auto(tokenizer):
    return make_client(tokenizer, ChatOptions(True, "hermes", "qwen3"))


def chat(c: TestClient, **body):
    return c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 8, **body})


# ---------------------------------------------------------------------- request -> params
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}
MAPPINGS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA))),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
    ({"guided_grammar": 'root ::= "b"'}, StructuredOutputsParams(grammar='root ::= "b"')),
    ({}, None),
]


@pytest.mark.parametrize(("fields", "expected"), MAPPINGS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_constraint_fields_become_structured_outputs(plain, path, fields, expected):
    c, engine = plain
    body = {"messages": USER} if "chat" in path else {"prompt": "Hi"}
    r = c.post(path, json={**body, "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text
    assert engine.params.structured_outputs == expected


DEEP: list = [1]
for _ in range(40):
    DEEP = [DEEP]
BAD = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format",
     ["response_format", "guided_regex", "only one"]),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"], "guided_json": {}},
     "structured_outputs", ["structured_outputs", "guided_json", "guided_choice"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     ["json_schema.schema"]),
    ({"response_format": {"type": "json_schema"}}, "response_format", ["json_schema.schema"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format", ["schema"]),
    ({"response_format": {"type": "yaml"}}, "response_format", ["response_format"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     ["exactly one"]),
    ({"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
    ({"guided_choice": []}, "guided_choice", ["non-empty"]),
    ({"guided_regex": ""}, "guided_regex", ["non-empty"]),
    ({"guided_json": {"a": DEEP}}, "guided_json", ["deeper"]),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_constraints_get_400_naming_the_fields(plain, path, fields, param, words):
    c, _ = plain
    body = {"messages": USER} if "chat" in path else {"prompt": "Hi"}
    r = c.post(path, json={**body, **fields})
    assert_error(r, param, words)
    assert c.post(path, json={**body, "max_tokens": 1}).status_code == 200


def assert_error(r, param: str, words: list[str]) -> None:
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    for word in words:
        assert word in err["error"]["message"], err


# ---------------------------------------------------------------------- tools: requests
BAD_TOOLS = [
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", ["--enable-auto-tool-choice"]),
    ({"tools": [WEATHER]}, "tool_choice", ["--enable-auto-tool-choice"]),  # auto by default
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", ["unique", "get_weather"]),
    ({"tools": [{"type": "function", "function": {"name": " "}}], "tool_choice": "required"},
     "tools", ["empty"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools", ["tools[0].function.parameters", "object"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", []),
    ({"tools": [{"type": "function"}]}, "tools", ["function"]),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["'nope'"]),
    ({"tool_choice": "required"}, "tool_choice", ["no tools"]),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", []),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", ["response_format and tool_choice"]),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_TOOLS)
def test_bad_tools_get_400(plain, fields, param, words):
    c, _ = plain
    assert_error(chat(c, **fields), param, words)
    assert chat(c).status_code == 200


def test_required_and_named_choices_become_a_calls_schema(plain):
    c, engine = plain
    assert chat(c, tools=[WEATHER, TIME], tool_choice="required").status_code == 200
    schema = engine.params.structured_outputs.json
    assert engine.params.structured_outputs.disable_any_whitespace
    assert schema["minItems"] == 1 and "maxItems" not in schema
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "get_weather", "arguments": {"city": "Paris"}},
                               {"name": "get_time", "arguments": {}}])
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "arguments": {}}])  # city required
    assert not validator.is_valid([{"name": "other", "arguments": {}}])
    assert chat(c, tools=[WEATHER, TIME], tool_choice="required",
                parallel_tool_calls=False).status_code == 200
    assert engine.params.structured_outputs.json["maxItems"] == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    assert chat(c, tools=[WEATHER, TIME], tool_choice=named).status_code == 200
    validator = jsonschema.Draft202012Validator(engine.params.structured_outputs.json)
    assert validator.is_valid([{"name": "get_time", "arguments": {"tz": "UTC"}}])
    assert not validator.is_valid([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert not validator.is_valid([{"name": "get_time", "arguments": {}}] * 2)
    # A function without parameters takes an empty object.
    bare = {"type": "function", "function": {"name": "ping"}}
    assert chat(c, tools=[bare], tool_choice="required").status_code == 200
    assert jsonschema.Draft202012Validator(engine.params.structured_outputs.json).is_valid(
        [{"name": "ping", "arguments": {}}])


def test_tools_and_earlier_calls_reach_the_template(plain):
    c, engine = plain
    messages = [*USER,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = chat(c, messages=messages, tools=[WEATHER, TIME], tool_choice="none")
    assert r.status_code == 200, r.text
    prompt = engine.calls[-1][0]
    assert "TOOL get_weather object\nTOOL get_time object\n" in prompt
    assert "assistant:  CALL call_1 get_weather city=Paris" in prompt  # arguments as a dict
    assert "tool: 18 C ANSWERS call_1" in prompt
    assert engine.params.structured_outputs is None  # "none": nothing forced, nothing parsed
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    # Arguments that are not a JSON object stay text; nesting past any stack is no 500.
    for args in ("not json", "[" * 100_000, json.dumps({"a": DEEP})):
        messages[1]["tool_calls"][0]["function"]["arguments"] = args
        r = chat(c, messages=messages, tools=[WEATHER], tool_choice="none")
        assert r.status_code == (400 if "a" in args else 200), r.text


# ---------------------------------------------------------------------- tools: answers
FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def test_forced_answer_becomes_tool_calls_for_the_openai_client(plain):
    c, engine = plain
    engine.script = ['[{"name": "get_', 'weather", "argu', 'ments": {"city"', ': "Paris"}}]']
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c)
    out = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER],
                                         tool_choice="required", max_tokens=32)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model="m", messages=USER, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=32,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(t.index == 0 and t.id is None for t in calls[1:]) and len(calls) > 2
    assert "".join(t.function.arguments for t in calls) == call.function.arguments
    assert all(not d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    engine.script = ["Hello"]


def test_forced_answer_that_is_not_calls_stays_content(plain):
    """Without the engine's grammar the model may ignore the schema: its text is kept."""
    c, engine = plain
    engine.script = ["It is ", "sunny."]
    r = chat(c, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert r["message"] == {"role": "assistant", "content": "It is sunny."}
    assert r["finish_reason"] == "stop"
    engine.script = ["Hello"]


def sse_events(r) -> list[dict]:
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


@pytest.mark.parametrize("logprobs", [False, True])
def test_auto_reasoning_and_calls_stream_equals_whole(auto, logprobs):
    c, engine = auto
    engine.script = ["<thi", "nk>Weather, so", " a tool.</th", "ink>\n\nSure.", " <tool", "_call>\n",
                     '{"name": "get_weather", "arguments": {"ci', 'ty": "Paris"}}\n</tool_call>',
                     "\n<tool_call>", '{"name": "get_time"}', "</tool_call>"]
    body = {"tools": [WEATHER, TIME], "n": 2, "logprobs": logprobs}
    whole = chat(c, **body).json()
    r = chat(c, **body, stream=True)
    events = sse_events(r)
    for index in (0, 1):
        message = whole["choices"][index]["message"]
        assert message["reasoning_content"] == "Weather, so a tool."
        assert message["content"] == "Sure."
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]] == [
            ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
        assert whole["choices"][index]["finish_reason"] == "tool_calls"
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == index]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == message["content"]
        assert "<" not in "".join(d.get("content", "") for d in deltas)
        calls: dict[int, list[str]] = {}
        for d in deltas:
            for t in d.get("tool_calls", []):
                if t["index"] not in calls:
                    assert t["id"].startswith("call_") and t["type"] == "function"
                    calls[t["index"]] = [t["function"]["name"], ""]
                calls[t["index"]][1] += t["function"]["arguments"]
        assert [tuple(v) for _, v in sorted(calls.items())] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in message["tool_calls"]]
        finishes = [e["choices"][0]["finish_reason"] for e in events
                    if e["choices"][0]["index"] == index and e["choices"][0]["finish_reason"]]
        assert finishes == ["tool_calls"]
    engine.script = ["Hello"]


def test_auto_without_calls_is_plain_content(auto):
    c, engine = auto
    engine.script = ["The weather", " is fine."]
    r = chat(c, tools=[WEATHER]).json()["choices"][0]
    assert r["message"] == {"role": "assistant", "content": "The weather is fine."}
    assert r["finish_reason"] == "stop"
    # A constrained answer is not read for reasoning (it has no room for tags).
    engine.script = ["<think>x</think>{}"]
    r = chat(c, response_format={"type": "json_object"}).json()["choices"][0]
    assert r["message"]["content"] == "<think>x</think>{}"
    engine.script = ["Hello"]


def test_mistral_keeps_special_tokens(tokenizer):
    c, engine = make_client(tokenizer, ChatOptions(True, "mistral"))
    assert chat(c, tools=[WEATHER]).status_code == 200
    assert engine.params.skip_special_tokens is False
    assert chat(c).status_code == 200  # no tools: nothing to read
    assert engine.params.skip_special_tokens is True


def test_harmony_answer_is_split_and_keeps_special_tokens(tokenizer):
    """gpt-oss: the harmony parsers ask for the markers (special tokens) to be kept; the
    analysis channel is the reasoning, the call addressed to functions.* the tool call,
    streamed or not."""
    c, engine = make_client(tokenizer, ChatOptions(True, "openai", "gpt_oss"))
    engine.script = ["<|channel|>analysis<|message|>Need the", " weather.<|end|><|start|>assistant",
                     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
                     '{"city": ', '"Paris"}<|call|>']
    r = chat(c, tools=[WEATHER]).json()["choices"][0]
    assert engine.params.skip_special_tokens is False
    assert r["message"]["reasoning_content"] == "Need the weather."
    assert r["message"]["content"] is None and r["finish_reason"] == "tool_calls"
    (call,) = r["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    engine.script = ["<|channel|>analysis<|message|>Greet back.<|end|>",
                     "<|start|>assistant<|channel|>final<|message|>Hi", "!"]
    assert chat(c).json()["choices"][0]["message"] == {
        "role": "assistant", "content": "Hi!", "reasoning_content": "Greet back."}
    assert engine.params.skip_special_tokens is False  # the reasoning parser alone asks too


# ---------------------------------------------------------------------- flags
def test_flags_build_chat_options():
    parser = make_arg_parser()
    args = parse_args(parser, ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                               "--reasoning-parser", "deepseek_r1"])
    assert chat_options(args) == ChatOptions(True, "llama3_json", "deepseek_r1")
    assert chat_options(parse_args(parser, [])) == ChatOptions()
    with pytest.raises(ValueError, match="--tool-call-parser"):
        chat_options(parse_args(parser, ["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        parse_args(parser, ["--tool-call-parser", "nope"])
