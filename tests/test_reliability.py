"""The server under faults, floods and hostile input, in process: a tiny random llama (with
SmolLM2's tokenizer, so text prompts and chat work) behind the real app, served by uvicorn on
127.0.0.1 in a thread, so that the engine can be slowed, held, poisoned or broken on purpose.

Each test states one promise: a request either completes correctly or gets an explicit
OpenAI-style error; a fault ends only the requests it touched; blocks always return to the
pool; nothing a client sends yields a 5xx, a traceback or a file path.
(The real SmolLM2 server under load and SIGTERM is test_reliability_server.py.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import uvicorn
from server_process import free_port

from pagedllm.config import EngineConfig, default_model_path
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import ServerLimits

API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny"
MAX_LEN = 256
NUM_BLOCKS = 128
POISON = 1234  # a token whose hidden state the poisoned model turns into NaN


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random llama over SmolLM2's vocabulary, with its tokenizer and chat template."""
    from hf_models import save_tiny_model

    from pagedllm.tokenizers import gguf_tokenizer

    path = tmp_path_factory.mktemp("tiny-smol")
    tok = gguf_tokenizer(default_model_path())
    save_tiny_model(str(path), "llama", vocab_size=len(tok), max_position_embeddings=512)
    tok.save_pretrained(str(path))
    return str(path)


def make_engine(path: str) -> AsyncLLM:
    return AsyncLLM(EngineConfig(model=path, served_model_name=[MODEL],
                                                max_model_len=MAX_LEN, num_kv_blocks=NUM_BLOCKS), in_process=True)


@pytest.fixture(scope="module")
def engine(tiny_dir) -> Iterator[AsyncLLM]:
    e = make_engine(tiny_dir)
    yield e
    e.shutdown()


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """`app` on a loopback port, served by uvicorn on a thread, for as long as the block runs."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def make_app(engine: AsyncLLM, **kwargs):
    kwargs.setdefault("api_key", API_KEY)
    return build_app(engine, engine.config, **kwargs)


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    """The default app (API key, default limits) over the shared engine."""
    with serve(make_app(engine)) as u:
        yield u


def http(url: str, **kw) -> httpx.Client:
    return httpx.Client(base_url=url, headers=AUTH, timeout=30, **kw)


def wait_idle(engine: AsyncLLM, timeout: float = 10.0) -> None:
    """Until nothing runs or waits and every block is back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks:
            return
        assert time.monotonic() < deadline, f"the engine did not go idle: {s}"
        time.sleep(0.02)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["message"]
    assert err["error"]["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if code is not None:
        assert err["error"]["code"] == code, err
    assert_no_internals(r.text)
    return err["error"]


def assert_no_internals(text: str, leaks: tuple[str, ...] = ("Traceback", 'File "', "/home/secret",
                                                           ".py", "pydantic", '"loc"', '"input"')
                        ) -> None:
    for leak in leaks:
        assert leak not in text, f"{leak!r} in {text[:500]}"


def sse_events(r: httpx.Response) -> list[str]:
    return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def completion(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, **kw}


@contextlib.contextmanager
def slow_steps(engine: AsyncLLM, seconds: float) -> Iterator[None]:
    step = engine.core.step
    engine.core.step = lambda: (time.sleep(seconds), step())[1]
    try:
        yield
    finally:
        del engine.core.step  # the class's method again


def failed_requests(engine: AsyncLLM) -> float:
    return engine.metrics.registry.get_sample_value(
        "pagedllm:request_success_total", {"model_name": MODEL, "finished_reason": "error"}) or 0


def run_all(*calls: Callable[[], object]) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(c) for c in calls]]


# ---------------------------------------------------------------------- faults
def test_nan_logits_fail_that_request_alone(engine, url, monkeypatch):
    """A request whose logits turn NaN ends with a clear error, at once (prefill) or
    mid-stream (decode); the requests batched with it are untouched."""
    clean = [completion([100 + i, 200 + i, 300 + i], max_tokens=12, ignore_eos=True)
             for i in range(6)]
    with http(url) as c:
        alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in clean]
    runner = engine.core.executor
    forward = runner.model.forward

    def poisoned(ids, *args):
        hidden = forward(ids, *args)
        if hidden.shape[0] != ids.shape[0]:  # only the sampled rows came back (meta.keep_rows)
            ids = ids.index_select(0, args[-1].keep_rows)
        return hidden.masked_fill((ids == POISON)[:, None], float("nan"))

    monkeypatch.setattr(runner.model, "forward", poisoned)
    errors_before = failed_requests(engine)

    def poisoned_prompt():
        with http(url) as c:
            return c.post("/v1/completions", json=completion([5, 6, POISON], max_tokens=12))

    def poisoned_later():  # its first token is POISON: the step after it fails
        body = completion([7, 8, 9], max_tokens=12, stream=True, logit_bias={str(POISON): 100})
        with http(url) as c, c.stream("POST", "/v1/completions", json=body) as r:
            return r.status_code, sse_events(r)

    def clean_one(body):
        with http(url) as c:
            return c.post("/v1/completions", json=body)

    with slow_steps(engine, 0.01):
        results = run_all(poisoned_prompt, poisoned_later, *[lambda b=b: clean_one(b) for b in clean])
    err = assert_openai_error(results[0], 500, "generation_failed")
    assert "non-finite logits" in err["message"]
    status, events = results[1]
    assert status == 200 and events[-1] == "[DONE]"
    first = json.loads(events[0])["choices"][0]
    assert first["finish_reason"] is None  # it had begun
    last = json.loads(events[-2])
    assert last["error"]["code"] == "generation_failed" and "non-finite" in last["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in results[2:]] == alone
    wait_idle(engine)
    assert engine.is_healthy
    assert failed_requests(engine) == errors_before + 2


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, url, monkeypatch):
    runner = engine.core.executor
    execute = runner.execute
    armed = threading.Event()

    def execute_once_broken(so):
        if armed.is_set() and so.chunks:
            armed.clear()
            raise RuntimeError("device error in /home/secret/kernels.py line 7")
        return execute(so)

    monkeypatch.setattr(runner, "execute", execute_once_broken)
    armed.set()
    with http(url) as c:
        err = assert_openai_error(c.post("/v1/completions", json=completion("Hi", max_tokens=4)),
                                  500, "generation_failed")
        assert "RuntimeError" in err["message"]
        ok = c.post("/v1/completions", json=completion("Hi", max_tokens=4))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
        assert c.get("/health").status_code == 200
    wait_idle(engine)


def test_an_engine_that_cannot_go_on_is_unhealthy_and_fails_fast(tiny_dir, monkeypatch):
    """Steps that keep failing (a broken device) kill the engine after a few tries; then
    /health says 503 and every request is refused at once instead of hanging."""
    engine = make_engine(tiny_dir)
    try:
        def broken(so):
            raise RuntimeError("CUDA error: an illegal memory access at /home/secret/a.py")

        monkeypatch.setattr(engine.core.executor, "execute", broken)
        with serve(make_app(engine)) as u, http(u) as c:
            codes = [c.post("/v1/completions", json=completion("Hi", max_tokens=3)).json()
                     ["error"]["code"] for _ in range(engine.max_step_failures)]
            assert codes == ["generation_failed"] * (engine.max_step_failures - 1) + \
                ["engine_unavailable"]
            assert not engine.is_healthy
            assert_openai_error(c.get("/health"), 503)
            for body in (completion("Hi", max_tokens=3), completion("Hi", stream=True)):
                t0 = time.monotonic()
                err = assert_openai_error(c.post("/v1/completions", json=body), 503,
                                          "engine_unavailable")
                assert time.monotonic() - t0 < 1.0
                assert "internal error" in err["message"]
    finally:
        engine.shutdown()


def test_an_engine_loop_failure_ends_streams_with_an_error(tiny_dir, monkeypatch):
    """A failure outside the model step (here the scheduler) leaves state that cannot be
    trusted: the engine stops at once, and a stream in flight ends with an error event."""
    engine = make_engine(tiny_dir)
    try:
        with serve(make_app(engine)) as u, http(u) as c:
            body = completion("Tell me", max_tokens=200, ignore_eos=True, stream=True)
            with slow_steps(engine, 0.01), c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                monkeypatch.setattr(engine.core.scheduler, "schedule",
                                    lambda: 1 / 0)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
            assert rest[-1] == "[DONE]"
            err = json.loads(rest[-2])["error"]
            assert err["code"] == "engine_unavailable" and "ZeroDivisionError" in err["message"]
            assert c.get("/health").status_code == 503
    finally:
        engine.shutdown()


def test_internal_errors_show_no_traceback_or_path(engine, url, monkeypatch):
    from pagedllm.entrypoints.openai.serving_engine import DeltaTracker, OpenAIServing

    def boom(*_a, **_k):
        raise RuntimeError('Traceback (most recent call last):\n  File "/home/secret/x.py"')

    with http(url) as c:
        monkeypatch.setattr(OpenAIServing, "encode", boom)
        err = assert_openai_error(c.post("/v1/completions", json=completion("Hi")), 500)
        assert "RuntimeError" in err["message"]
        err = assert_openai_error(c.post("/tokenize", json={"prompt": "Hi"}), 500)
        monkeypatch.undo()
        # After the response has begun, the error is the stream's last event.
        update = DeltaTracker.update
        calls = []

        def update_then_fail(self, *args):
            calls.append(1)
            if len(calls) > 2:
                boom()
            return update(self, *args)

        monkeypatch.setattr(DeltaTracker, "update", update_then_fail)
        body = completion("Hi", max_tokens=20, ignore_eos=True, stream=True)
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        assert_no_internals("\n".join(events))
    wait_idle(engine)


# ---------------------------------------------------------------------- admission, timeouts
def test_waiting_requests_are_capped_with_503_and_retry_after(engine, monkeypatch):
    app = make_app(engine, limits=ServerLimits(max_waiting_requests=2))
    gate = threading.Event()
    step = engine.core.step
    monkeypatch.setattr(engine.core, "step", lambda: (gate.wait(20), step())[1])
    body = completion("Hello", max_tokens=3)
    with serve(app) as u, http(u) as c, concurrent.futures.ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(c.post, "/v1/completions", json=body) for _ in range(2)]
        deadline = time.monotonic() + 10
        while app.state.admission.waiting < 2:  # both wait: the engine is held
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = c.post("/v1/completions", json=body)
        err = assert_openai_error(refused, 503, "server_overloaded")
        assert refused.headers["retry-after"] == "1" and "retry" in err["message"].lower()
        client = openai.OpenAI(base_url=f"{u}/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert e.value.code == "server_overloaded"
        # One request of three prompts can never fit a queue of two.
        assert_openai_error(c.post("/v1/completions", json=completion(["a", "b", "c"])), 400)
        gate.set()
        assert [f.result(timeout=30).status_code for f in queued] == [200, 200]
        assert app.state.admission.waiting == 0
        assert c.post("/v1/completions", json=body).status_code == 200
    wait_idle(engine)


def test_admission_counts_sequences_and_bounds_one_requests_share(engine, monkeypatch):
    """prompts x n is what a request puts in the queue; one request may take at most a
    quarter of the cap, refused before its prompts are read."""
    from pagedllm.entrypoints.openai.serving_engine import OpenAIServing

    app = make_app(engine, limits=ServerLimits(max_waiting_requests=8))
    with serve(app) as u, http(u) as c:
        assert c.post("/v1/completions", json=completion("Hi", max_tokens=2, n=2)).status_code == 200
        encode = OpenAIServing.encode
        monkeypatch.setattr(OpenAIServing, "encode", lambda *a, **k: pytest.fail("tokenized"))
        for body in (completion("Hi", max_tokens=2, n=3), completion(["a", "b"], max_tokens=2, n=2)):
            err = assert_openai_error(c.post("/v1/completions", json=body), 400)
            assert "sequences" in err["message"] and "--max-waiting-requests" in err["message"]
            assert err["param"] == "n"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 3}
        assert "sequences" in assert_openai_error(c.post("/v1/chat/completions", json=chat), 400)["message"]
        monkeypatch.setattr(OpenAIServing, "encode", encode)
        assert app.state.admission.waiting == 0
    wait_idle(engine)


def test_a_response_too_large_to_send_is_refused_before_it_runs(engine):
    """echo + logprobs + n multiply what a response carries: past --max-response-logprobs
    the request is a 400 that names the bound, and nothing runs."""
    app = make_app(engine, limits=ServerLimits(max_response_logprobs=1000))
    prompt = list(range(100, 150))  # 50 tokens
    with serve(app) as u, http(u) as c:
        big = completion(prompt, echo=True, logprobs=5, n=2, max_tokens=40)  # 2 x 90 x 6 entries
        err = assert_openai_error(c.post("/v1/completions", json=big), 400)
        assert "--max-response-logprobs" in err["message"] and "1080" in err["message"]
        assert err["param"] == "logprobs"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                "top_logprobs": 20, "max_tokens": 100}
        err = assert_openai_error(c.post("/v1/chat/completions", json=chat), 400)
        assert err["param"] == "top_logprobs"
        ok = completion(prompt, echo=True, logprobs=5, n=2, max_tokens=10)  # 2 x 60 x 6 = 720
        r = c.post("/v1/completions", json=ok)
        assert r.status_code == 200 and len(r.json()["choices"][1]["logprobs"]["tokens"]) == 60
    wait_idle(engine)


def test_a_prompt_too_long_to_fit_is_refused_unread(engine, url, monkeypatch):
    """Characters are counted before anything is tokenized: megabytes of prompt are a quick
    400, not seconds of tokenizing on the server."""
    from pagedllm.entrypoints.openai.serving_engine import OpenAIServing

    monkeypatch.setattr(OpenAIServing, "encode", lambda *a, **k: pytest.fail("tokenized"))
    huge = "word " * (MAX_LEN * OpenAIServing.MAX_CHARS_PER_TOKEN // 5 + 1)
    with http(url) as c:
        t0 = time.monotonic()
        for path, body in (("/v1/completions", completion(huge)),
                           ("/v1/completions", completion(["short", huge])),
                           ("/v1/chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": huge}]})):
            err = assert_openai_error(c.post(path, json=body), 400, "context_length_exceeded")
            assert "characters" in err["message"]
        assert time.monotonic() - t0 < 5
        assert c.get("/health").status_code == 200


def test_request_timeout_aborts_and_frees_blocks(engine):
    app = make_app(engine, limits=ServerLimits(request_timeout=0.5))
    long = completion("Once", max_tokens=200, ignore_eos=True)
    with serve(app) as u, http(u) as c, slow_steps(engine, 0.02):  # 200 steps: 4 s
        t0 = time.monotonic()
        err = assert_openai_error(c.post("/v1/completions", json=long), 504, "request_timeout")
        assert time.monotonic() - t0 < 2.5 and "0.5 s" in err["message"]
        wait_idle(engine)
        t0 = time.monotonic()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert time.monotonic() - t0 < 2.5
        assert events[-1] == "[DONE]" and len(events) > 3  # tokens came, then the error
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        wait_idle(engine)
        short = c.post("/v1/completions", json=completion("Once", max_tokens=3))
        assert short.status_code == 200


async def leave_mid_stream(c: httpx.AsyncClient, body: dict) -> None:
    """Stream a completion up to its first event, then hang up."""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break


def test_client_disconnects_free_everything(engine, url):
    """Clients that leave mid-stream or before an answer, many at once: every request is
    aborted and the pool is full again."""
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
            async def leave_early(i: int) -> None:
                with contextlib.suppress(httpx.TimeoutException):
                    await c.post("/v1/completions", timeout=0.3,
                                 json=completion(f"Tale {i}", max_tokens=240, ignore_eos=True))

            await asyncio.gather(*(leave_mid_stream(c, completion(f"Story {i}", max_tokens=240, ignore_eos=True,
                                                                  stream=True)) for i in range(8)),
                                 *(leave_early(i) for i in range(8)))

    with slow_steps(engine, 0.05):  # 240 tokens would take 12 s: longer than the wait below
        asyncio.run(scenario())
        wait_idle(engine, timeout=5)


# ---------------------------------------------------------------------- bad input
HUGE = 10**30
BAD_JSON = [
    # (raw body, headers) that are not a request at all
    (b'{"prompt": "x", "max_tokens": 3', None),
    (b'\xff\xfe{"prompt": "x"}', None),  # not UTF-8
    (b'{"prompt": "\xc3\x28"}', None),  # invalid UTF-8 inside a string
    (b"[" * 100_000 + b"]" * 100_000, None),  # nesting deeper than any parser's stack
    (b'{"prompt": ' + b"9" * 5000 + b"}", None),  # an integer of 5000 digits
    (b"null", None),
    (b'"just a string"', None),
    (b'{"prompt": "x"}', {"Content-Type": "text/plain"}),
]
BAD_FIELDS = [
    # (path, body, param named in the error or None)
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": -Infinity}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages"),
    ("/v1/completions", '{"prompt": "x", "stop": ["ok", "\\ud83d"]}', "stop"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "n": HUGE}, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": HUGE}, "best_of"),
    ("/v1/completions", {"prompt": "x", "max_tokens": HUGE}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": HUGE}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": HUGE}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "min_tokens": HUGE}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**70, "temperature": 1}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [HUGE]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}},
     "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": HUGE}}, "logit_bias"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],  # to Jinja: bounded
                              "chat_template_kwargs": {"a": [[[[[[[[[1]]]]]]]]]}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"a": list(range(2000))}}, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": [HUGE]}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "maybe"}, "stream"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": HUGE},
     "logprobs"),
    ("/v1/chat/completions", {"messages": {"role": "user"}}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1000},
     "n"),
    ("/detokenize", {"tokens": [HUGE]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
]


@pytest.mark.parametrize(("body", "headers"), BAD_JSON, ids=[f"raw-{i}" for i in range(len(BAD_JSON))])
def test_what_is_not_a_request_gets_400(url, body, headers):
    with http(url) as c:
        assert_openai_error(c.post("/v1/completions", content=body,
                                   headers=headers or {"Content-Type": "application/json"}), 400)
        assert c.post("/v1/completions", json=completion("Hi", max_tokens=1)).status_code == 200


@pytest.mark.parametrize(("path", "body", "param"), BAD_FIELDS,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD_FIELDS)])
def test_bad_fields_get_400_naming_them(engine, url, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    with http(url) as c:
        r = c.post(path, content=content, headers={"Content-Type": "application/json"})
        err = assert_openai_error(r, 400)
        if param is not None:
            assert err["param"] == param, err
        assert "\\ud8" not in r.text.lower() and "\\udf" not in r.text.lower()  # not echoed
        assert c.post("/v1/completions", json=completion("Hi", max_tokens=1)).status_code == 200
    wait_idle(engine)


def test_unknown_fields_are_ignored_not_fatal(url, caplog):
    """Newer clients send fields this server does not know: they are logged (quoted and
    shortened, so a client cannot forge log lines) and the request runs."""
    body = completion("Hi", max_tokens=1, **{"future_field": 1, "x\nFAKE LOG LINE" * 20: 2})
    with http(url) as c, caplog.at_level("WARNING"):
        assert c.post("/v1/completions", json=body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "unsupported" in r.getMessage()]
    assert lines and all("\n" not in line and len(line) < 300 for line in lines)


def test_body_size_limit_gives_413(engine):
    app = make_app(engine, limits=ServerLimits(max_request_body_bytes=2000))
    big = json.dumps(completion("word " * 1000, max_tokens=1)).encode()

    def chunks():
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    with serve(app) as u, http(u) as c:
        assert_openai_error(c.post("/v1/completions", content=big,
                                   headers={"Content-Type": "application/json"}),
                            413, "request_too_large")
        r = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert "content-length" not in r.request.headers  # sent chunked: counted as it came
        assert_openai_error(r, 413, "request_too_large")
        assert c.post("/v1/completions", json=completion("Hi", max_tokens=1)).status_code == 200
    with serve(make_app(engine)) as u, http(u) as c:  # the default limit: 4 MiB
        r = c.post("/v1/completions", content=b" " * (4 * 2**20 + 1),
                   headers={"Content-Type": "application/json"})
        assert_openai_error(r, 413, "request_too_large")


def test_protocol_errors_and_probes_get_http_answers(url):
    """Below the API: headers past the bound get 431 in OpenAI's error shape (the HTTP
    parser alone takes headers of any size), malformed framing gets the HTTP layer's 400,
    never a reset connection; probes may ask with HEAD."""
    with http(url) as c:
        assert_openai_error(c.get("/v1/models", headers={"X-Big": "a" * (65 * 1024)}), 431,
                            "headers_too_large")
        assert c.get("/v1/models", headers={"X-Fine": "a" * 8000}).status_code == 200
        for path in ("/health", "/ready", "/version"):
            r = c.head(path)
            assert r.status_code == 200 and r.content == b"", path
    port = int(url.rsplit(":", 1)[1])
    malformed = [
        b"HELLO THERE\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n",
    ]
    for raw in malformed:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 "), (raw, answer[:200])


def test_schema_fuzzing_finds_no_server_error(engine):
    """Every operation of the server's own OpenAPI document, with bodies that fit the schema
    and bodies that do not (schemathesis): never a 5xx, and every error OpenAI-shaped."""
    schemathesis = pytest.importorskip("schemathesis")  # pyproject's [test] extra
    from hypothesis import HealthCheck, given, settings

    app = make_app(engine, api_key=None)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    seen: dict[tuple[str, int], int] = {}

    def fuzz(op, mode) -> None:
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case):
            if mode == modes[0] and isinstance(case.body, dict):
                case.body.pop("model", None)  # the server's one model: reach the engine
                # Valid but long requests (n=128 up to the context's end) only cost time:
                # a few tokens each reach every code path a long answer does.
                keys = {"/v1/completions": ("max_tokens",),
                        "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                        "/v1/responses": ("max_output_tokens",)}
                for key in keys.get(op.path, ()):
                    v = case.body.get(key)
                    case.body[key] = 4 if v is None else min(v, 4)
                # /tokenize takes exactly one of prompt and messages, which its schema cannot
                # say: left to chance, all 25 bodies may have both or neither.
                if op.path == "/tokenize" and (case.body.get("prompt") is None) == (
                        case.body.get("messages") is None):
                    case.body.pop("messages", None)
                    case.body["prompt"] = case.body.get("prompt") or "hello"
                if op.path == "/detokenize" and isinstance(case.body.get("tokens"), list):
                    # in the vocabulary, as most random ids are not
                    case.body["tokens"] = [abs(t) % 32 for t in case.body["tokens"]]
            r = case.call(timeout=60)
            seen[(op.path, r.status_code)] = seen.get((op.path, r.status_code), 0) + 1
            assert r.status_code < 500, (op.path, case.body, r.text[:500])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert err["message"] and err["type"] == "invalid_request_error"
                assert_no_internals(r.text, ("Traceback", 'File "', "pydantic", '"loc"'))

        check()

    for result in schema.get_all_operations():
        op = result.ok()
        # Only a request body can be wrong in ways a schema allows: operations without one
        # (GETs, DELETEs, POST .../cancel) take nothing to negate.
        for mode in modes if len(op.body) else modes[:1]:
            fuzz(op, mode)
    # The fuzzer got past validation too, on every endpoint that generates.
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert seen.get((path, 200)), (path, seen)
    wait_idle(engine)


# ---------------------------------------------------------------------- security
def test_every_route_but_the_open_ones_needs_the_key(engine):
    from starlette.routing import Route

    app = make_app(engine)
    open_paths = {"/health", "/ready", "/version", "/dashboard", "/metrics", "/dashboard/data"}
    routes = [r for r in app.routes if isinstance(r, Route)]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= {r.path for r in routes}
    with serve(app) as u, httpx.Client(base_url=u, timeout=30) as c:
        for route in routes:
            for method in sorted(route.methods - {"HEAD"}):
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": f"Basic {API_KEY}"},
                                {"Authorization": f"Bearer {API_KEY}x"}):
                    r = c.request(method, route.path, headers=headers)
                    if route.path in open_paths:
                        assert r.status_code == 200, route.path
                    else:
                        assert_openai_error(r, 401, "invalid_api_key")
    # --health-require-api-key closes the probes too.
    closed = make_app(engine, health_require_api_key=True)
    with serve(closed) as u, httpx.Client(base_url=u, timeout=30) as c:
        for path in ("/health", "/ready", "/version"):
            assert_openai_error(c.get(path), 401, "invalid_api_key")
            assert c.get(path, headers=AUTH).status_code == 200
        assert c.get("/metrics").status_code == 200  # its own flag


def test_the_key_is_compared_in_constant_time(engine, monkeypatch):
    """Digests of equal length are compared with hmac.compare_digest, whatever was sent."""
    from fastapi.testclient import TestClient

    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with TestClient(make_app(engine)) as c:
        for key in ("", "k", API_KEY[:-1], API_KEY, API_KEY * 50):
            c.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert len(compared) == 5 and len(set(compared)) == 1


def test_cors_is_off_unless_origins_are_given(engine):
    origin = "https://app.example.com"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with serve(make_app(engine)) as u, httpx.Client(base_url=u, timeout=30) as c:
        r = c.get("/v1/models", headers={**AUTH, "Origin": origin})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    with serve(make_app(engine, allowed_origins=[origin])) as u, \
            httpx.Client(base_url=u, timeout=30) as c:
        r = c.options("/v1/completions", headers=preflight)  # no key: preflights carry none
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/v1/models", headers={**AUTH, "Origin": origin})
        assert r.headers["access-control-allow-origin"] == origin
        r = c.get("/v1/models", headers={**AUTH, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        bad = c.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in bad.headers
        assert c.get("/v1/models", headers={"Origin": origin}).status_code == 401


# ---------------------------------------------------------------------- pagedllm bench serve
@pytest.mark.parametrize("pacing", [["--max-concurrency", "3"], ["--request-rate", "40"]])
def test_bench_serve_measures_a_running_server(engine, tmp_path, pacing):
    from pagedllm.entrypoints.bench import build_parser

    out = tmp_path / "serve.json"
    with serve(make_app(engine)) as u:
        args = build_parser().parse_args([
            "serve", "--base-url", u, "--api-key", API_KEY, "--num-prompts", "6",
            "--input-len", "16", "--output-len", "8", "--warmup", "1", *pacing,
            "--output-json", str(out)])
        args.bench_run(args)
    saved = json.loads(out.read_text())
    r = saved["results"]
    assert (r["completed"], r["failed"]) == (6, 0), saved["errors"]
    assert r["total_input_tokens"] == 6 * 16 and r["total_output_tokens"] == 6 * 8
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{name}_ms"] <= r[f"p99_{name}_ms"], name
        assert r[f"mean_{name}_ms"] > 0, name
    assert r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert r["output_throughput"] > 0 and r["request_throughput"] > 0
    assert saved["server"]["model"] == MODEL and saved["environment"]["git"] is not None
    json.dumps(saved, allow_nan=False)  # plain JSON: no Infinity


def test_bench_serve_on_random_weights_with_a_word_tokenizer(tmp_path):
    """How gpu-7b's serving latency is measured: an architecture config with random
    weights, a word-per-id tokenizer, prompts drawn from the vocabulary."""
    from transformers import AutoTokenizer

    from pagedllm.entrypoints.bench import build_parser
    from pagedllm.entrypoints.bench_workloads import write_arch_config, write_word_tokenizer

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}
    path = write_arch_config(config, str(tmp_path))
    write_word_tokenizer(path, 300)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [0, 299, 17, 42]
    assert tok.decode(ids) == "w0 w299 w17 w42" and tok.encode("w0 w299 w17 w42", add_special_tokens=False) == ids
    e = AsyncLLM(EngineConfig(model=path, load_format="dummy", served_model_name=[MODEL],
                                             num_kv_blocks=64), in_process=True)
    out = tmp_path / "serve.json"
    try:
        with serve(make_app(e, api_key=None)) as u:
            args = build_parser().parse_args([
                "serve", "--base-url", u, "--num-prompts", "4", "--input-len", "12",
                "--output-len", "6", "--warmup", "1", "--prompt-vocab-size", "300",
                "--max-concurrency", "2", "--output-json", str(out)])
            args.bench_run(args)
    finally:
        e.shutdown()
    r = json.loads(out.read_text())["results"]
    assert (r["completed"], r["total_input_tokens"], r["total_output_tokens"]) == (4, 48, 24)


def test_async_scheduling_engine_serves_aborts_and_times_out_cleanly(tiny_dir):
    """The server over an engine with async scheduling on (the CUDA default, forced here
    on CPU): concurrent answers equal the ones given alone, clients that leave and
    requests that time out free every block while a step may still be in flight."""
    e = AsyncLLM(EngineConfig(model=tiny_dir, served_model_name=[MODEL], max_model_len=MAX_LEN,
                                             num_kv_blocks=NUM_BLOCKS, async_scheduling=True), in_process=True)
    try:
        assert e.core.async_scheduling
        bodies = [completion([100 + i, 200 + i, 300 + i], max_tokens=10, ignore_eos=True) for i in range(6)]
        with serve(make_app(e, limits=ServerLimits(request_timeout=0.5))) as u, http(u) as c:
            alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]

            def one(b):
                with http(u) as cc:
                    return cc.post("/v1/completions", json=b).json()["choices"][0]["text"]

            assert run_all(*[lambda b=b: one(b) for b in bodies]) == alone

            async def leave() -> None:
                async with httpx.AsyncClient(base_url=u, headers=AUTH, timeout=30) as ac:
                    await asyncio.gather(*(leave_mid_stream(ac, completion(f"Story {i}", max_tokens=200,
                                                                           ignore_eos=True, stream=True))
                                           for i in range(6)))

            with slow_steps(e, 0.02):
                asyncio.run(leave())
                wait_idle(e, timeout=5)
                assert_openai_error(c.post("/v1/completions", json=completion("Once", max_tokens=200,
                                                                               ignore_eos=True)), 504, "request_timeout")
                wait_idle(e, timeout=5)
            assert c.post("/v1/completions", json=bodies[0]).json()["choices"][0]["text"] == alone[0]
    finally:
        e.shutdown()
