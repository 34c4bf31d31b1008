"""HTTP as clients, proxies and Kubernetes assume it (OpenAI's API reference, RFC 9110, the
Kubernetes probe docs): what a malformed request is told, in plain words and OpenAI's error
shape; the headers that go with an answer (Allow, WWW-Authenticate, Retry-After,
X-Request-Id); liveness and readiness through a drain; and that no answer shows where the
server keeps its files.

Most promises are checked in process (the app over a stand-in engine); one real server, over
a model in a temporary directory, shows the last two under load.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_process import launch_server
from test_metrics import _StandInEngine
from test_server import _RecordingEngine

from pagedllm.config import EngineConfig, default_model_path
from pagedllm.entrypoints.openai.api_server import build_app

API_KEY = "semantics-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]
# What a message must never hold: Python's and pydantic's words, tracebacks, source files.
INTERNALS = ("Traceback", 'File "', ".py", "pydantic", "Value error", "value_error", '"loc"',
             '"input"', '"ctx"', "CompletionRequest", "ChatCompletionRequest", "TokenizeRequest",
             "object to extract fields", "unsupported operand", "NoneType")


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None,
                        code: str | None = None) -> str:
    """The error object OpenAI's clients parse, as JSON, free of internals; its message."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert err["param"] == param and err["code"] == code, err
    for leak in INTERNALS:
        assert leak not in r.text, f"{leak!r} in {r.text}"
    return err["message"]


# ---------------------------------------------------------------------- in process
class _Engine(_RecordingEngine):
    """The recording engine (answers "ok" at once) with the stats and metrics the dashboard
    and /metrics read."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        metered = _StandInEngine()
        self.metrics, self.stats = metered.metrics, metered.stats


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.model_source import resolve_source
    from pagedllm.tokenizers import load_tokenizer

    return load_tokenizer(resolve_source(default_model_path(), "auto"))


@pytest.fixture
def model_dir(tmp_path) -> str:
    """Where the stand-in's model 'lives': no answer may name it."""
    path = tmp_path / "secret-models" / "my-model"
    path.mkdir(parents=True)
    return str(path)


def client(engine, model: str, **kwargs) -> TestClient:
    kwargs.setdefault("api_key", API_KEY)
    app = build_app(engine, EngineConfig(model=model), **kwargs)
    return TestClient(app, headers=AUTH, raise_server_exceptions=False)


@pytest.fixture
def app(tokenizer, model_dir) -> Iterator[tuple[TestClient, _Engine]]:
    engine = _Engine(tokenizer)
    with client(engine, model_dir) as http:
        yield http, engine


JSON_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
VALID = {"/v1/completions": {"prompt": "Hi"}, "/v1/chat/completions": {"messages": CHAT},
         "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1, 2]}}


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
@pytest.mark.parametrize("path", JSON_ROUTES)
def test_a_body_not_sent_as_json_names_the_content_type_header(app, path, content_type):
    """400 (as OpenAI answers a body it cannot read; the openai client raises
    BadRequestError), saying which header to send and what this request sent."""
    http, _ = app
    headers = {"Content-Type": content_type} if content_type else {}
    r = http.post(path, content=json.dumps(VALID[path]).encode(), headers=headers)
    message = assert_openai_error(r, 400)
    assert "Content-Type: application/json" in message
    assert (content_type.split(";")[0] if content_type else "has none") in message


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/merge-patch+json"])
def test_json_content_types_are_read(app, content_type):
    http, _ = app
    r = http.post("/v1/completions", content=b'{"prompt": "Hi"}',
                  headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"), ("GET", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/chat/completions", "POST"), ("DELETE", "/v1/models", "GET"),
    ("POST", "/v1/models", "GET"), ("POST", "/health", "GET"),
    ("PATCH", "/tokenize", "POST"),
])
def test_a_wrong_method_is_405_with_allow(app, method, path, allow):
    http, _ = app
    r = http.request(method, path)
    message = assert_openai_error(r, 405)
    assert set(r.headers["allow"].split(", ")) == set(allow.split(", "))
    assert f"({method} {path})" in message and message.endswith(allow)


@pytest.mark.parametrize("path", ["/v1/chat/completion", "/v2/models", "/v1/audio/speech",
                                  "/nothing/here"])
def test_an_unknown_path_is_404_in_openai_shape(app, path):
    http, _ = app
    for method in ("GET", "POST"):
        message = assert_openai_error(http.request(method, path, json={}), 404)
        assert message.startswith(f"Invalid URL ({method} {path})")


@pytest.mark.parametrize(("body", "says"), [
    (b'{"prompt": "Hi",}', "not valid JSON: Expecting property name enclosed in double "
                           "quotes at character 16"),
    (b'{"prompt": "Hi"', "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', "not valid JSON: it is not UTF-8 text"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
    (b"", "the request body is empty"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"Hi"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
])
def test_a_body_that_is_not_a_json_object_gets_a_plain_400(app, body, says):
    http, _ = app
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert says in assert_openai_error(r, 400)


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, "n", "valid integer"),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt", "invalid value"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop", "invalid value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, "logit_bias", "dictionary"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, "seed", "less than or equal"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "x"}},
     "stream_options", "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format",
     "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages",
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": "calculator"}, "tools", "valid list"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function",
                                                           "function": {"name": 5}}]},
     "tools", "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": {"type": "function"}},
     "tool_choice", "invalid value"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"a": [[[[[[[[[1]]]]]]]]]}},
     "chat_template_kwargs", "chat_template_kwargs nests deeper than 8 levels"),
    ("/tokenize", {"prompt": ["x"]}, "prompt", "prompt"),
])
def test_a_bad_field_gets_a_plain_message_naming_it(app, path, body, param, says):
    http, _ = app
    message = assert_openai_error(http.post(path, json=body), 400, param)
    assert says in message
    assert not message.startswith(f"{param}: {param}")  # the field named once


def test_lone_surrogates_name_their_field(app):
    http, _ = app
    r = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": '
                  b'"\\ud800"}]}', headers={"Content-Type": "application/json"})
    assert "messages[0].content is not valid Unicode" in assert_openai_error(r, 400, "messages")


def test_chat_template_failures_are_plain_and_name_no_path(tokenizer, model_dir):
    """A model without a chat template is named as such (a tokenizer's own words name a
    Python argument, or its path); a template that fails on a client's value in Python's
    words ('unsupported operand type(s)') gets a plain message, the details in the log."""
    import copy

    bare = copy.copy(tokenizer)
    bare.chat_template = None
    with client(_Engine(bare), model_dir) as http:
        message = assert_openai_error(http.post("/v1/chat/completions", json={"messages": CHAT}),
                                      400, "messages")
        assert "no chat template" in message and "--chat-template" in message
        assert model_dir not in message
    template = "{{ messages[0].content + extra }}"
    with client(_Engine(tokenizer), model_dir, chat_template=template) as http:
        r = http.post("/v1/chat/completions",
                      json={"messages": CHAT, "chat_template_kwargs": {"extra": 1}})
        assert "cannot apply the chat template" in assert_openai_error(r, 400, "messages")
        r = http.post("/v1/chat/completions",
                      json={"messages": CHAT, "chat_template_kwargs": {"extra": "!"}})
        assert r.status_code == 200, r.text


def test_401_says_bearer_and_overload_says_when_to_retry(app):
    http, _ = app
    r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert_openai_error(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"
    admission = http.app.state.admission
    admission.max_waiting, admission.waiting = 8, 8  # the queue is full
    try:
        r = http.post("/v1/completions", json={"prompt": "Hi"})
        assert_openai_error(r, 503, code="server_overloaded")
        assert r.headers["retry-after"] == "1"
    finally:
        admission.max_waiting, admission.waiting = 0, 0


def test_a_request_id_comes_back_on_every_answer(app):
    http, _ = app
    rid = {"X-Request-Id": "client-trace-42"}
    answers = [
        http.post("/v1/completions", json={"prompt": "Hi"}, headers=rid),
        http.post("/v1/completions", json={"prompt": "Hi", "n": 0}, headers=rid),  # 400
        http.get("/v1/models", headers={**rid, "Authorization": "Bearer wrong"}),  # 401
        http.get("/no/such/route", headers=rid),  # 404
        http.get("/health", headers=rid),
    ]
    with http.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "stream": True},
                     headers=rid) as r:
        r.read()
        answers.append(r)
    for r in answers:
        assert r.headers["x-request-id"] == "client-trace-42", (r.status_code, r.url)
    assert "x-request-id" not in http.post("/v1/completions", json={"prompt": "Hi"}).headers


def test_liveness_stays_up_through_a_drain_while_readiness_goes_down(app):
    """Kubernetes' split: a failing readiness probe takes the pod out of the load balancer,
    a failing liveness probe restarts it. Draining, the server wants the first, not the
    second; a stopped engine wants both."""
    http, engine = app
    for path in ("/health", "/ready"):
        assert http.get(path, headers={}).status_code == 200  # no key needed
        assert http.head(path, headers={}).status_code == 200
    drain = http.app.state.drain
    drain.start()
    try:
        r = http.get("/ready", headers={})
        assert_openai_error(r, 503, code="shutting_down")
        assert r.headers["retry-after"] and r.headers["connection"] == "close"
        assert http.head("/ready", headers={}).status_code == 503
        assert http.get("/health", headers={}).status_code == 200
        assert http.head("/health", headers={}).status_code == 200
        assert http.get("/metrics").status_code == 200
    finally:
        drain.started = None
    engine.is_healthy = False
    try:
        for path in ("/health", "/ready"):
            assert_openai_error(http.get(path, headers={}), 503, code="engine_unavailable")
    finally:
        engine.is_healthy = True


def test_models_lists_a_local_model_by_its_name_not_its_path(tokenizer, model_dir):
    name = Path(model_dir).name
    for model, served, expected in (
        (model_dir, None, [(name, name)]),
        (model_dir + "/", ["alias", "other"], [("alias", name), ("other", name)]),
        (str(Path(model_dir) / "weights.Q4_0.gguf"), None,
         [("weights.Q4_0", "weights.Q4_0.gguf")]),
        ("Qwen/Qwen3-0.6B", None, [("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B")]),
    ):
        app = build_app(_Engine(tokenizer), EngineConfig(model=model, served_model_name=served))
        with TestClient(app) as http:
            cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == expected, model


# ---------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """The server over a tiny random llama (SmolLM2's tokenizer and chat template) in a
    temporary directory, given by its path and no --served-model-name: (url, model dir)."""
    from hf_models import save_tiny_model

    from pagedllm.tokenizers import gguf_tokenizer

    root = tmp_path_factory.mktemp("secret-place")
    path = root / "tiny-chat"
    tok = gguf_tokenizer(default_model_path())
    save_tiny_model(str(path), "llama", vocab_size=len(tok), max_position_embeddings=512)
    tok.save_pretrained(str(path))
    flags = ["--model", str(path), "--max-model-len", "512", "--num-kv-blocks", "256",
             "--max-num-seqs", "32"]
    with launch_server(root, flags, api_key=API_KEY) as sp:
        yield sp.url, str(path)


def test_no_answer_names_the_servers_files(tiny_server):
    """Every informational endpoint and a spread of error answers, with and without the
    key: neither the model's directory nor any part of the temporary tree appears."""
    url, model_dir = tiny_server
    name = Path(model_dir).name
    secret = str(Path(model_dir).parent)
    ctype = {"Content-Type": "application/json"}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["root"]) for c in cards] == [(name, name)]
        answers = [
            http.get("/v1/models"), http.get("/version"), http.get("/health"), http.get("/ready"),
            http.get("/metrics"), http.get("/dashboard"), http.get("/dashboard/data"),
            http.get("/v1/engine/stats"), http.get("/openapi.json"),
            http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}),
            http.post("/v1/completions", json={"prompt": "x " * 600}),
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}),
            http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}),
            http.post("/v1/chat/completions", json={"messages": CHAT, "tools": "x"}),
            http.post("/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": 4, "response_format": {
                    "type": "json_schema", "json_schema": {"name": "x", "schema": {
                        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}),
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                               "guided_regex": "("}),
            http.post("/v1/completions", content=b"{", headers=ctype),
            http.post("/v1/completions", content=b"prompt=x"),
            http.post("/tokenize", json={"messages": CHAT}),
            http.post("/detokenize", json={"tokens": [10**9]}),
            http.get("/v1/completions"), http.get("/nowhere"),
            http.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
        ]
    for r in answers:
        shown = r.text + json.dumps(dict(r.headers))
        assert secret not in shown and "secret-place" not in shown, (r.request.url, r.text[:300])
        assert "Traceback" not in shown and 'File "' not in shown, (r.request.url, r.text[:300])
        if r.status_code >= 400:
            assert r.headers["content-type"] == "application/json", r.request.url


def test_the_openai_client_sees_names_and_request_ids(tiny_server):
    url, model_dir = tiny_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    (card,) = client.models.list().data
    assert card.id == Path(model_dir).name and model_dir not in card.model_dump_json()
    rid = {"X-Request-Id": "trace-7"}
    out = client.completions.create(model=card.id, prompt="Hi", max_tokens=2, extra_headers=rid)
    assert out._request_id == "trace-7" and out.choices  # as the client documents it
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=card.id, prompt="Hi", temperature=-1, extra_headers=rid)
    assert e.value.request_id == "trace-7" and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi", extra_headers=rid)
    assert e.value.request_id == "trace-7" and e.value.code == "model_not_found"


def test_probes_answer_fast_under_load(tiny_server):
    """Liveness and readiness answer within Kubernetes' default probe timeout (1 s) while
    the server streams to many clients at once."""
    url, _ = tiny_server
    body = {"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "stream": True}

    def stream(_: int) -> list[str]:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")]

    latencies: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        streams = [pool.submit(stream, i) for i in range(24)]
        time.sleep(1.0)  # under way
        with httpx.Client(base_url=url, timeout=10) as probe:
            while not all(s.done() for s in streams) and len(latencies) < 60:
                for path in ("/health", "/ready"):
                    t0 = time.monotonic()
                    assert probe.get(path).status_code == 200
                    latencies.append(time.monotonic() - t0)
                time.sleep(0.05)
        for s in streams:  # each to its end
            events = s.result()
            assert events[-1] == "data: [DONE]" and '"error"' not in events[-2]
    assert len(latencies) >= 10, "the streams ended before the probes could run"
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
