"""/v1/responses end to end: the real SmolLM2 server and the official openai client's
`responses.create` / `responses.stream`. Greedy answers are compared with the chat
endpoint's for the same conversation (the Responses API is a chat in another spelling),
and the stream with the whole answer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_process import launch_server

from pagedllm.entrypoints.openai.responses_store import ResponseStore

STORE_MAX = 3
GREEDY = dict(model="smol", temperature=0, max_output_tokens=12)


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    flags = ["--max-context-length", "1024", "--num-kv-blocks", "256", "--served-model-name",
             "smol", "--responses-store-max", str(STORE_MAX)]
    with launch_server(tmp_path_factory.mktemp("responses-server"), flags) as sp:
        yield sp.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def chat_answer(client: openai.OpenAI, messages: list[dict], **kw):
    out = client.chat.completions.create(model="smol", messages=messages, temperature=0,
                                         max_completion_tokens=12, **kw)
    return out.choices[0].message.content, out.usage.prompt_tokens


def test_text_equals_chat_and_stream(client: openai.OpenAI):
    resp = client.responses.create(input="Name a color.", instructions="Answer briefly.", **GREEDY)
    assert resp.status in ("completed", "incomplete") and resp.id.startswith("resp_")
    text, prompt_tokens = chat_answer(client, [{"role": "system", "content": "Answer briefly."},
                                               {"role": "user", "content": "Name a color."}])
    assert resp.output_text == text
    assert resp.usage.input_tokens == prompt_tokens and resp.usage.output_tokens > 0
    kinds, deltas = [], []
    with client.responses.stream(input="Name a color.", instructions="Answer briefly.",
                                 **GREEDY) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == resp.output_text == final.output_text
    assert len(deltas) > 1
    last = "response.completed" if resp.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", last]
    # The raw create(stream=True) spelling gives the same text.
    raw = client.responses.create(input="Name a color.", instructions="Answer briefly.",
                                  stream=True, **GREEDY)
    assert "".join(e.delta for e in raw if e.type == "response.output_text.delta") == text


def test_two_turns_through_previous_response_id(client: openai.OpenAI):
    first = client.responses.create(input=[{"role": "user", "content": "My name is Ada."}],
                                    **GREEDY)
    second = client.responses.create(input="What is my name?",
                                     previous_response_id=first.id, **GREEDY)
    messages = [{"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    text, prompt_tokens = chat_answer(client, messages)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens  # the first turn was carried
    assert second.output_text == text
    # Retrieve and delete.
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_store_evicts_least_recently_used(client: openai.OpenAI):
    ids = [client.responses.create(input=f"Say {i}.", model="smol", max_output_tokens=2).id
           for i in range(STORE_MAX)]
    client.responses.retrieve(ids[0])  # now the most recently used
    newer = client.responses.create(input="Say more.", model="smol", max_output_tokens=2).id
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(ids[1])  # the least recently used went
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Go on.", previous_response_id=ids[1], model="smol",
                                max_output_tokens=2)
    for kept in (ids[0], ids[2], newer):
        assert client.responses.retrieve(kept).id == kept
    unstored = client.responses.create(input="Hi.", model="smol", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_json_schema_format(client: openai.OpenAI):
    schema = {"type": "object", "properties": {"color": {"type": "string"}},
              "required": ["color"], "additionalProperties": False}
    resp = client.responses.create(
        model="smol", input="Give a color as JSON.", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "color", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), schema)


def test_function_tools(client: openai.OpenAI):
    params = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city",
            "parameters": params}
    resp = client.responses.create(model="smol", input="Weather in Paris?", tools=[tool],
                                   tool_choice="required", max_output_tokens=48, temperature=0)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), params)
    with client.responses.stream(model="smol", input="Weather in Paris?", tools=[tool],
                                 tool_choice="required", max_output_tokens=48,
                                 temperature=0) as stream:
        kinds = [ev.type for ev in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [(c.name, c.arguments) for c in streamed.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    # The call's result goes back as a function_call_output item of the next turn.
    follow = client.responses.create(
        model="smol", previous_response_id=resp.id, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}])
    assert follow.usage.input_tokens > resp.usage.input_tokens


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "not found"),
    ({"input": []}, 400, "empty"),
    ({"input": [{"type": "image", "url": "x"}]}, 400, "not supported"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "function tools"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
])
def test_bad_requests(url: str, body: dict, status: int, words: str):
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_background_responses(client: openai.OpenAI, url: str):
    """`background=True`: the create call returns at once (queued), GET shows the answer
    when it ends (the same text as in the foreground), `cancel` stops a running one (its
    engine request aborted, the server serving on); only background responses can be
    cancelled, and a background response must be stored and not streamed."""
    import time

    ask = dict(input="Name a color.", instructions="Answer briefly.", **GREEDY)
    queued = client.responses.create(background=True, **ask)
    assert queued.status == "queued" and queued.background and queued.output == []
    for _ in range(1200):
        got = client.responses.retrieve(queued.id)
        if got.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    foreground = client.responses.create(**ask)
    assert got.status == foreground.status and got.output_text == foreground.output_text
    assert got.usage.output_tokens == foreground.usage.output_tokens
    long = client.responses.create(input="Count from 1 to 500, one number per line.", model="smol",
                                   temperature=0, max_output_tokens=900, background=True)
    stopped = client.responses.cancel(long.id)
    assert stopped.status == "cancelled" and stopped.output == []
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.create(**ask).output_text == foreground.output_text  # serving on
    for _ in range(100):  # the cancelled request leaves the engine (the gauge is sampled)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        running = [ln for ln in metrics.splitlines() if ln.startswith("pagedllm:num_requests_running")]
        if running and float(running[0].split()[-1]) == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"requests still running: {running}")
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(foreground.id)
    for extra, words in (({"store": False}, "stored"), ({"stream": True}, "not streamed")):
        r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "background": True, **extra}, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_unknown_id_gets_openai_404(url: str):
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
        r = httpx.request(method, f"{url}/v1/responses/resp_nope{path}", timeout=10)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_store_bounds():
    store = ResponseStore(max_responses=10, max_bytes=1000)
    for i in range(5):
        assert store.put(f"r{i}", {"text": "x" * 250}, [])
    assert len(store) < 5 and store.bytes <= 1000  # the byte bound evicted the oldest
    assert "r4" in store and "r0" not in store
    assert not store.put("big", {"text": "x" * 2000}, [])  # larger than the whole store
    assert store.delete("r4") and "r4" not in store
