"""The OpenAI-compatible server, end to end: one real server (a subprocess on a free port,
SmolLM2-135M-Instruct) driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from server_process import launch_server

API_KEY = "test-key-123"
SERVED = ["smollm2", "smol"]
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_LEN = 2048
NUM_BLOCKS = 512
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_ANSWER = "The capital of France is Paris."


@dataclass
class Server:
    url: str
    log: Path

    def http(self, api_key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    """Started the way the seed article writes it, with the API key from the environment."""
    flags = ["--max-context-length", str(MAX_LEN), "--num-kv-blocks", str(NUM_BLOCKS),
             "--served-model-name", *SERVED]
    with launch_server(tmp_path_factory.mktemp("server"), flags, api_key=API_KEY) as sp:
        yield Server(sp.url, sp.log)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _engine_stats(server: Server) -> dict:
    with server.http() as http:
        return http.get("/v1/engine/stats").json()


def _wait_until_idle(server: Server, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = _engine_stats(server)
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"the engine did not go idle: {stats}")
        time.sleep(0.1)


def _sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


# ---------------------------------------------------------------------- startup, info
def test_startup_prints_what_to_tune(server: Server):
    log = server.log.read_text()
    for expected in (FILE_NAME, "dtype ", f"{NUM_BLOCKS} blocks x 16 tokens",
                     f"{NUM_BLOCKS * 16} tokens",
                     f"the KV pool holds {NUM_BLOCKS * 16 // MAX_LEN} sequences of {MAX_LEN} tokens",
                     "max_num_batched_tokens", f"{server.url}/v1", "API key required"):
        assert expected in log, f"{expected!r} missing from the startup output:\n{log}"
    assert API_KEY not in log


def test_health_version_models(server: Server, client: openai.OpenAI):
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == SERVED
    assert all(m.object == "model" and m.owned_by for m in models)


@pytest.mark.parametrize("name", [*SERVED, FILE_NAME, FILE_NAME.removesuffix(".gguf")])
def test_model_is_addressable_by_every_alias(client: openai.OpenAI, name: str):
    out = client.completions.create(model=name, prompt="Hello", max_tokens=1)
    assert out.model == SERVED[0] and len(out.choices) == 1


# ---------------------------------------------------------------------- chat
def test_chat_greedy_answer_and_usage(server: Server, client: openai.OpenAI):
    out = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0,
                                         max_tokens=20)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == FRANCE_ANSWER
    assert choice.finish_reason == "stop"
    with server.http() as http:
        prompt = http.post("/tokenize", json={"messages": FRANCE}).json()
    assert out.usage.prompt_tokens == prompt["count"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert 0 < out.usage.completion_tokens <= 20


def test_chat_stream_equals_non_stream(client: openai.OpenAI):
    kwargs = dict(model="smol", messages=FRANCE, temperature=0, max_tokens=20)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len({c.id for c in chunks}) == 1


def test_chat_logprobs(client: openai.OpenAI):
    out = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0,
                                         max_tokens=8, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    # The eos token that ended the answer is scored too, though not part of the text.
    assert "".join(t.token for t in content) == FRANCE_ANSWER + "<|im_end|>"
    for t in content:
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.logprob == pytest.approx(tops[0])
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token


def test_chat_n_streamed(client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model="smol", messages=FRANCE, n=2, temperature=1.0, seed=3, max_tokens=6, stream=True))
    texts: dict[int, str] = {0: "", 1: ""}
    finished = []
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.append(ch.index)
    assert sorted(finished) == [0, 1]
    full = client.chat.completions.create(model="smol", messages=FRANCE, n=2, temperature=1.0,
                                          seed=3, max_tokens=6)
    assert [c.message.content for c in full.choices] == [texts[0], texts[1]]


# ---------------------------------------------------------------------- completions
def test_completion_defaults_to_16_tokens(client: openai.OpenAI):
    out = client.completions.create(model="smol", prompt="Once upon a time",
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_completion_prompt_forms(server: Server, client: openai.OpenAI):
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "The sky is"
    kw = dict(model="smol", max_tokens=5, temperature=0)
    by_text = client.completions.create(prompt="The sky is", **kw).choices[0].text
    assert client.completions.create(prompt=ids, **kw).choices[0].text == by_text
    out = client.completions.create(prompt=["The sky is", "Water is"], n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == by_text
    out = client.completions.create(prompt=[ids, ids[:2]], **kw)
    assert out.choices[0].text == by_text
    assert out.usage.prompt_tokens == len(ids) + 2
    assert out.usage.completion_tokens == 10


def test_completion_stream_is_sse_ending_with_done(server: Server):
    body = {"model": "smol", "prompt": ["Hi", "Hello there"], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "extra": 1}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = _sse_lines(r)
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1  # one response
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]) == [0, 1]


def test_completion_stream_equals_non_stream(client: openai.OpenAI):
    kw = dict(model="smol", prompt="The three primary colors are", max_tokens=12, temperature=0,
              logprobs=1)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert sum((c.choices[0].logprobs.tokens for c in chunks), []) == full.logprobs.tokens
    assert chunks[-1].choices[0].finish_reason == full.finish_reason == "length"


def test_completion_logprobs(client: openai.OpenAI):
    out = client.completions.create(model="smol", prompt="The sky is", max_tokens=6,
                                    temperature=0, logprobs=2)
    lp, text = out.choices[0].logprobs, out.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and top[tok] == pytest.approx(logprob)
        assert len(top) >= 2 and max(top.values()) == pytest.approx(logprob)  # greedy


def test_completion_echo(server: Server, client: openai.OpenAI):
    prompt = "The sky is"
    with server.http() as http:
        n_prompt = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    out = client.completions.create(model="smol", prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert len(choice.logprobs.tokens) == n_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(x <= 0 for x in choice.logprobs.token_logprobs[1:])
    # max_tokens=0 with echo scores the prompt alone.
    scored = client.completions.create(model="smol", prompt=prompt, max_tokens=0, echo=True,
                                       logprobs=0)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:n_prompt]
    streamed = list(client.completions.create(model="smol", prompt=prompt, max_tokens=3,
                                              temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_echo_logprobs_are_whole_with_a_warm_prefix_cache(server: Server, client: openai.OpenAI):
    """Scoring as evaluation harnesses do (echo, logprobs, max_tokens 0), through the official
    client: a prompt of several KV blocks scored twice (the second time its blocks are in
    the prefix cache), and a prompt that shares its first blocks, get one logprob per
    prompt token, the same each time."""
    shared = " ".join(f"item {i} is a {'red' if i % 2 else 'blue'} stone;" for i in range(12))
    prompts = [shared + " The last one is green.", shared + " The last one is green.",
               shared + " Nothing else is in the box."]
    with server.http() as http:
        counts = [http.post("/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    assert counts[0] > 48  # at least three blocks of 16 tokens shared
    scored = [client.completions.create(model="smol", prompt=p, max_tokens=0, echo=True,
                                        logprobs=1).choices[0].logprobs for p in prompts]
    for lp, n in zip(scored, counts, strict=True):
        assert len(lp.tokens) == len(lp.token_logprobs) == n
        assert lp.token_logprobs[0] is None
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert scored[1].token_logprobs == pytest.approx(scored[0].token_logprobs, abs=1e-4)
    common = next(i for i, (a, b) in enumerate(zip(scored[0].tokens, scored[2].tokens,
                                                   strict=False)) if a != b)
    assert common > 48
    assert scored[2].token_logprobs[:common] == pytest.approx(scored[0].token_logprobs[:common],
                                                              abs=1e-4)


def test_n_and_seed_reproducibility(client: openai.OpenAI):
    kw = dict(model="smol", prompt="My favourite animal is", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw, n=3, seed=42)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert first.usage.completion_tokens == 3 * 8
    again = client.completions.create(**kw, n=3, seed=42)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in range(1, 5)}
    assert len(others | {first.choices[0].text}) > 1, "different seeds should sample differently"


def test_stop_strings_are_cut_and_never_streamed(client: openai.OpenAI):
    kw = dict(model="smol", messages=FRANCE, temperature=0, max_tokens=20)
    for stop in (["Paris"], ["of Fr", "nothing"]):
        full = client.chat.completions.create(**kw, stop=stop).choices[0]
        cut = FRANCE_ANSWER[: FRANCE_ANSWER.index(stop[0])]
        assert full.message.content == cut and full.finish_reason == "stop"
        chunks = [c.choices[0].delta.content or "" for c in
                  client.chat.completions.create(**kw, stop=stop, stream=True) if c.choices]
        assert "".join(chunks) == cut
        assert not any(stop[0][:2] in c for c in chunks)
    kept = client.chat.completions.create(
        **kw, stop="Paris", extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == "The capital of France is Paris"


def test_vllm_extra_sampling_parameters(server: Server, client: openai.OpenAI):
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=5)
    sampled = client.completions.create(**kw, temperature=0.8, seed=1, extra_body={
        "top_k": 1, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 5,
        "ignore_eos": True, "skip_special_tokens": True})
    greedy = client.completions.create(**kw, temperature=0, presence_penalty=0.0,
                                       frequency_penalty=0.0, logit_bias={}, user="u",
                                       extra_body={"repetition_penalty": 1.1, "ignore_eos": True})
    assert sampled.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy
    assert sampled.usage.completion_tokens == 5
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": greedy.choices[0].text,
                                           "add_special_tokens": False}).json()["tokens"]
    stopped = client.completions.create(**kw, temperature=0, extra_body={
        "repetition_penalty": 1.1, "stop_token_ids": [ids[2]]}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ids[2]
    banned = client.completions.create(**kw, temperature=0, logit_bias={str(ids[0]): -100},
                                       extra_body={"repetition_penalty": 1.1})
    assert banned.choices[0].text != greedy.choices[0].text


# ---------------------------------------------------------------------- concurrency
def test_concurrent_requests_match_running_alone(client: openai.OpenAI):
    prompts = ["The sky is", "def fibonacci(n):", "Paris is the capital of",
               "Once upon a time, a", "1, 2, 3, 4,", "The best way to learn is"]

    def run(prompt: str) -> str:
        return client.completions.create(model="smol", prompt=prompt, max_tokens=10,
                                         temperature=0).choices[0].text

    alone = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone


# ---------------------------------------------------------------------- disconnects
def test_disconnected_stream_frees_its_blocks(server: Server):
    _wait_until_idle(server)
    body = {"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        busy = _engine_stats(server)
    assert busy["num_running"] == 1 and busy["kv_usage"] > 0
    stats = _wait_until_idle(server)
    assert stats["num_free_blocks"] == stats["num_blocks"] == NUM_BLOCKS


def test_disconnected_plain_request_is_aborted(server: Server):
    _wait_until_idle(server)
    body = {"model": "smol", "messages": FRANCE, "max_tokens": 1500, "ignore_eos": True}
    with server.http() as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=1.5)
    _wait_until_idle(server)  # 1500 tokens would take far longer than this


def test_client_leaving_while_its_request_is_queued_disturbs_nothing(tiny_models):
    """A disconnect can cancel a request before the engine loop has added it (the loop is
    busy with a step). The request must then never run, and the loop must live on."""
    import asyncio

    from pagedllm.config import EngineConfig
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.sampling_params import SamplingParams

    path, _ = tiny_models("llama")
    engine = AsyncLLM(EngineConfig(model=path, skip_tokenizer_init=True,
                                                  max_model_len=256, num_kv_blocks=64), in_process=True)
    step = engine.core.step
    engine.core.step = lambda: (time.sleep(0.05), step())[1]  # long steps: a wide window
    params = SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)

    async def consume(request_id: str) -> int:
        outputs = [out async for out in engine.generate(request_id, None, [1, 2, 3], params)]
        return len(outputs[-1].outputs[0].token_ids)

    async def scenario() -> int:
        busy = asyncio.create_task(consume("busy"))
        await asyncio.sleep(0.2)
        leaver = asyncio.create_task(consume("leaver"))
        await asyncio.sleep(0)  # its add is queued behind the running step
        leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        await asyncio.sleep(0.2)
        assert engine.is_healthy and engine.stats().num_running == 1
        return await busy

    try:
        assert asyncio.run(scenario()) == 40
        deadline = time.monotonic() + 5  # the stats snapshot follows the last output
        while engine.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats().num_running == 0 and engine.stats().kv_usage == 0
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- errors
TOO_LONG = "hello " * (MAX_LEN + 10)
BAD_REQUESTS = [
    # (path, body, status, param)
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": FRANCE}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": "many"}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**8]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["x", [1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[10**7]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1, 2]}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("/v1/completions", {"prompt": TOO_LONG, "stream": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [[10**7]], "stream": True}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": MAX_LEN}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": FRANCE, "temperature": "hot", "stream": True}, 400,
     "temperature"),
    ("/tokenize", {"prompt": "x", "messages": FRANCE}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_openai_error_and_nothing_else_breaks(server: Server, path, body,
                                                               status, param):
    with server.http() as http:
        r = http.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["param"] == param, err
        assert err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
        assert "pydantic" not in r.text and '"loc"' not in r.text and '"input"' not in r.text
        ok = http.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200
    if path != "/detokenize":
        assert _wait_until_idle(server)["num_free_blocks"] == NUM_BLOCKS


def test_malformed_json_and_unknown_route(server: Server):
    with server.http() as http:
        r = http.post("/v1/completions", content=b"{not json",
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = http.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["message"]


def test_errors_reach_the_openai_client_typed(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=FRANCE)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt=TOO_LONG)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", max_tokens=MAX_LEN, stream=True)
    assert e.value.param == "max_tokens"


def test_api_key_is_required(server: Server):
    for key in ("wrong-key", API_KEY + "x", API_KEY[:-1], API_KEY.upper()):
        bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model="smol", prompt="x", max_tokens=1)
        assert e.value.code == "invalid_api_key"
    with server.http(api_key=None) as http:
        for path in ("/v1/models", "/v1/engine/stats", "/tokenize"):
            r = http.request("GET" if "token" not in path else "POST", path, json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = http.post("/v1/completions", content=b"{bad", headers={"Authorization": "Basic abc"})
        assert r.status_code == 401  # the key is checked before the body is read
        assert http.get("/health").status_code == 200


def test_server_healthy_after_everything(server: Server, client: openai.OpenAI):
    assert httpx.get(f"{server.url}/health").status_code == 200
    out = client.chat.completions.create(model="smol", messages=FRANCE, temperature=0,
                                         max_tokens=20)
    assert out.choices[0].message.content == FRANCE_ANSWER
    assert _wait_until_idle(server)["num_free_blocks"] == NUM_BLOCKS


# ---------------------------------------------------------------------- build_app alone
class _RecordingEngine:
    """Enough of AsyncLLM to test the HTTP layer by itself: it records each request and
    answers "ok" at once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.max_model_len = MAX_LEN
        self.is_healthy = True
        self.calls: list[tuple] = []
        self.failure: BaseException | None = None  # raised after a first, partial output

    async def generate(self, request_id, prompt, prompt_token_ids, params):
        from pagedllm.outputs import CompletionOutput, RequestOutput

        self.calls.append((prompt, prompt_token_ids, params))
        finish = "stop" if self.failure is None else None
        outs = [CompletionOutput(i, "ok", [1], None, None, finish) for i in range(params.n)]
        yield RequestOutput(request_id, prompt, prompt_token_ids, outs, finished=finish is not None)
        if self.failure is not None:
            raise self.failure


CUSTOM_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def recorded():
    """An app over the recording engine, for a hub-style model id, with a custom chat
    template and no API key."""
    from fastapi.testclient import TestClient

    from pagedllm.config import EngineConfig, default_model_path
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.model_source import resolve_source
    from pagedllm.tokenizers import load_tokenizer

    engine = _RecordingEngine(load_tokenizer(resolve_source(default_model_path(), "auto")))
    app = build_app(engine, EngineConfig(model="Qwen/Qwen-7B-Chat"), chat_template=CUSTOM_TEMPLATE)
    with TestClient(app) as http:
        yield http, engine


def test_names_of_a_hub_model_and_no_key_needed(recorded):
    http, _ = recorded
    # Served under the hub id, as vLLM lists it; its last component is an alias.
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["Qwen/Qwen-7B-Chat"]
    for name in ("Qwen-7B-Chat", "Qwen/Qwen-7B-Chat", None):
        r = http.post("/v1/completions", json={"model": name, "prompt": "x"})
        assert r.status_code == 200 and r.json()["model"] == "Qwen/Qwen-7B-Chat"
    assert http.post("/v1/completions", json={"model": "Qwen", "prompt": "x"}).status_code == 404


def test_custom_chat_template_is_used(recorded):
    http, engine = recorded
    r = http.post("/v1/chat/completions", json={"messages": FRANCE})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    prompt, ids, _ = engine.calls[-1]
    assert prompt == "<user>" + FRANCE[0]["content"]
    assert ids == engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert http.post("/tokenize", json={"messages": FRANCE}).json()["tokens"] == ids


@pytest.mark.parametrize(("path", "extra", "max_tokens"), [
    ("/v1/chat/completions", {}, None),  # chat: the rest of the context
    ("/v1/chat/completions", {"max_tokens": 9}, 9),
    ("/v1/chat/completions", {"max_tokens": 9, "max_completion_tokens": 7}, 7),
    ("/v1/completions", {}, 16),  # completions: OpenAI's default
    ("/v1/completions", {"max_tokens": None}, None),
])
def test_max_tokens_defaults(recorded, path, extra, max_tokens):
    http, engine = recorded
    body = {"messages": FRANCE} if "chat" in path else {"prompt": "x"}
    assert http.post(path, json={**body, **extra}).status_code == 200
    assert engine.calls[-1][2].max_tokens == max_tokens


def test_request_fields_become_sampling_params(recorded):
    http, engine = recorded
    fields = {"n": 2, "temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.1,
              "frequency_penalty": 0.2, "seed": 7, "stop": ["a", "b"], "top_k": 5, "min_p": 0.1,
              "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True,
              "stop_token_ids": [3], "skip_special_tokens": False,
              "include_stop_str_in_output": True}
    for path, body, logprobs in (("/v1/completions", {"prompt": "x", "logprobs": 4}, 4),
                                 ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True,
                                                           "top_logprobs": 4}, 4)):
        r = http.post(path, json={**body, **fields, "logit_bias": {"5": -3}})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        params = engine.calls[-1][2]
        assert {k: getattr(params, k) for k in fields} == fields
        assert params.logit_bias == {5: -3.0} and params.logprobs == logprobs
    http.post("/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 2})
    assert engine.calls[-1][2].prompt_logprobs == 2


def test_engine_failure_is_reported_not_hung(recorded):
    from pagedllm.engine.async_engine import EngineDeadError

    http, engine = recorded
    engine.failure = EngineDeadError("engine loop failed: boom")
    try:
        r = http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        body = {"messages": FRANCE, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = _sse_lines(r)
        assert lines[-1] == "data: [DONE]"
        assert "boom" in json.loads(lines[-2][6:])["error"]["message"]
        engine.is_healthy = False
        assert http.get("/health").status_code == 503
    finally:
        engine.failure, engine.is_healthy = None, True
