"""Tool calling and structured output end to end: the real SmolLM2 server (hermes parser
for tool_choice "auto"), the official openai client and langchain-openai.

A forced tool choice and a structured-output request hold because the engine enforces
`SamplingParams.structured_outputs`: a 135M model does not write a JSON list of calls, or
JSON at all, unless held to it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_process import launch_server

MAX_TOKENS = 64
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "description": "The current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    flags = ["--max-context-length", "1024", "--num-kv-blocks", "256", "--served-model-name",
             "smol", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with launch_server(tmp_path_factory.mktemp("tools-server"), flags) as sp:
        yield sp.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_required_tool_choice_gives_parsable_calls(client: openai.OpenAI):
    out = client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],
                                         tool_choice="required", temperature=0,
                                         max_tokens=MAX_TOKENS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name == "get_weather"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER_PARAMS)  # the grammar held it to the schema


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tools_stream_equals_non_stream(client: openai.OpenAI, tool_choice: str):
    """Holds with or without the grammar: whatever the answer is, split or not."""
    kwargs = dict(model="smol", messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                  temperature=0, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for t in d.tool_calls or []:
            if t.index not in calls:
                assert t.id and t.function.name
                calls[t.index] = [t.function.name, ""]
            calls[t.index][1] += t.function.arguments or ""
    assert [tuple(v) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls or []]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.finish_reason]


def test_bad_tool_requests_get_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER, WEATHER],
                                       tool_choice="required", max_tokens=4)
    assert "unique" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}}, max_tokens=4)
    assert client.chat.completions.create(model="smol", messages=ASK, max_tokens=2).choices


@pytest.fixture(scope="module")
def chat_model(url: str):
    langchain_openai = pytest.importorskip("langchain_openai")  # pyproject's [test] extra
    return langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="x", model="smol",
                                       temperature=0, max_tokens=MAX_TOKENS, max_retries=0)


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny in {city}"


def test_langchain_bind_tools_auto(chat_model):
    """tool_choice "auto" (langchain's default) through the hermes parser: the answer is an
    AIMessage, with calls if the model wrote any."""
    msg = chat_model.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert isinstance(msg.content, str) and (msg.content or msg.tool_calls)
    for call in msg.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"], dict)


def test_langchain_bind_tools_named(chat_model):
    msg = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert isinstance(msg.tool_calls[0]["args"]["city"], str)


def test_langchain_structured_output(chat_model):
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        sunny: bool

    out = chat_model.with_structured_output(Weather).invoke(
        "Describe the weather in Paris as JSON.")
    assert isinstance(out, Weather)
