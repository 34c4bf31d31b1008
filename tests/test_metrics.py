"""GET /metrics, end to end: one real server (SmolLM2-135M-Instruct, a subprocess) scraped
with prometheus_client's own parser while requests run through it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from server_process import launch_server

API_KEY = "metrics-key-123"
MODEL = "smollm2"
MAX_LEN = 2048
NUM_BLOCKS = 512
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
          "kv_cache_blocks"]
COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
            "generation_tokens", "request_success"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds"]


# ---------------------------------------------------------------------- a real server
@dataclass
class Server:
    url: str
    log: Path

    def http(self, api_key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@contextlib.contextmanager
def running_server(log_dir: Path, *flags: str) -> Iterator[Server]:
    """The server as `pagedllm serve` starts it, with the API key from the environment, so
    that what is open without the key is tested too. Also used by test_dashboard."""
    base = ["--max-model-len", str(MAX_LEN), "--num-kv-blocks", str(NUM_BLOCKS),
            "--served-model-name", MODEL, *flags]
    with launch_server(log_dir, base, api_key=API_KEY) as sp:
        yield Server(sp.url, sp.log)


def wait_for(condition: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    """Poll until `condition()` is truthy; its value is returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("metrics")) as s:
        yield s


# ---------------------------------------------------------------------- scraping
class Scrape:
    """One parsed /metrics page: sample values by name and labels."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        """A sample's value; 0 for a labelled counter not created yet (as Prometheus reads
        a missing series of a counter)."""
        want = {"model_name": MODEL, **labels}
        for family in self.families.values():
            for s in family.samples:
                if s.name == sample and s.labels == want:
                    return s.value
        return 0.0


def scrape(server: Server) -> Scrape:
    r = httpx.get(f"{server.url}/metrics", timeout=30)  # no API key: open by default
    assert r.status_code == 200, r.text
    return Scrape(r.text)


def completion(server: Server, **body) -> dict:
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(server: Server, **body) -> dict:
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def idle(server: Server) -> Scrape:
    """Scrape once the engine has nothing running and every block is back in the pool."""
    def check() -> Scrape | None:
        m = scrape(server)
        quiet = (m.value("pagedllm:num_requests_running") == 0
                 and m.value("pagedllm:num_requests_waiting") == 0
                 and m.value("pagedllm:kv_cache_usage_perc") == 0)
        return m if quiet else None
    return wait_for(check, "the engine to go idle")


# ---------------------------------------------------------------------- tests
def test_exposition_names_types_and_labels(server: Server):
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200  # open although the server has an API key
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    with server.http(api_key=None) as http:
        assert http.get("/v1/models").status_code == 401  # ... which the API still requires
    m = Scrape(r.text)
    types = {name.removeprefix("pagedllm:"): f.type for name, f in m.families.items()
             if name.startswith("pagedllm:")}
    for name in GAUGES:
        assert types.get(name) == "gauge", name
    for name in COUNTERS:
        assert types.get(name) == "counter", name
    for name in HISTOGRAMS:
        assert types.get(name) == "histogram", name
    assert all(name.startswith("pagedllm:") for name in m.families), sorted(m.families)
    for family in m.families.values():
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
    assert m.value("pagedllm:kv_cache_blocks") == NUM_BLOCKS
    assert m.value("pagedllm:time_to_first_token_seconds_bucket", le="+Inf") == \
        m.value("pagedllm:time_to_first_token_seconds_count")


def test_counters_and_histograms_follow_requests(server: Server):
    before = idle(server)
    by_length = completion(server, prompt="Count: one, two,", max_tokens=7, ignore_eos=True)
    by_stop = chat(server, messages=FRANCE, max_tokens=40)
    assert by_length["choices"][0]["finish_reason"] == "length"
    assert by_stop["choices"][0]["finish_reason"] == "stop"
    after = scrape(server)

    def delta(sample: str, **labels: str) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    usages = [by_length["usage"], by_stop["usage"]]
    assert delta("pagedllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert delta("pagedllm:generation_tokens_total") == generated
    assert delta("pagedllm:request_success_total", finished_reason="length") == 1
    assert delta("pagedllm:request_success_total", finished_reason="stop") == 1
    assert delta("pagedllm:request_success_total", finished_reason="abort") == 0
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"pagedllm:{name}_seconds_count") == 2, name
    assert delta("pagedllm:inter_token_latency_seconds_count") == generated - 2
    assert delta("pagedllm:e2e_request_latency_seconds_sum") > 0
    # A request's end-to-end latency is at least its time to first token.
    assert delta("pagedllm:e2e_request_latency_seconds_sum") >= \
        delta("pagedllm:time_to_first_token_seconds_sum")


def test_prefix_cache_hits_when_a_long_prompt_repeats(server: Server):
    prompt = "Notes on paged attention, take 7: " + " ".join(
        f"block {i} holds sixteen tokens of the prompt;" for i in range(30))
    with server.http() as http:
        n = http.post("/tokenize", json={"prompt": prompt}).json()["count"]
    assert n >= 200
    m0 = idle(server)
    completion(server, prompt=prompt, max_tokens=1)
    m1 = idle(server)
    completion(server, prompt=prompt, max_tokens=1)
    m2 = idle(server)
    queries = [m.value("pagedllm:prefix_cache_queries_total") for m in (m0, m1, m2)]
    hits = [m.value("pagedllm:prefix_cache_hits_total") for m in (m0, m1, m2)]
    assert queries[1] - queries[0] >= n and queries[2] - queries[1] >= n
    assert hits[1] - hits[0] == 0  # a prompt never seen before
    assert hits[2] - hits[1] >= n - 2 * 16  # all its full blocks but (perhaps) the last


def test_gauges_while_a_long_stream_runs(server: Server):
    before = idle(server)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))

        def busy() -> Scrape | None:
            m = scrape(server)
            return m if m.value("pagedllm:num_requests_running") > 0 else None
        during = wait_for(busy, "a running request")
        assert during.value("pagedllm:num_requests_running") == 1
        assert during.value("pagedllm:num_requests_waiting") == 0
        usage = during.value("pagedllm:kv_cache_usage_perc")
        assert 0 < usage <= 1
        assert during.value("pagedllm:generation_tokens_total") > \
            before.value("pagedllm:generation_tokens_total")
    # Leaving the stream disconnects: the request is aborted and its blocks return.
    after = idle(server)
    assert after.value("pagedllm:request_success_total", finished_reason="abort") == \
        before.value("pagedllm:request_success_total", finished_reason="abort") + 1


# ---------------------------------------------------------------------- the key rule
class _StandInEngine:
    """What build_app needs of an AsyncLLM, with the real metrics registry."""

    def __init__(self) -> None:
        from pagedllm.engine.messages import SchedulerStats
        from pagedllm.metrics import EngineMetrics

        self.tokenizer = None
        self.max_model_len = MAX_LEN
        self.is_healthy = True
        self.metrics = EngineMetrics(MODEL)
        self._stats = SchedulerStats(0, 0, 0.0, NUM_BLOCKS, NUM_BLOCKS, 0, 0, 0)

    def stats(self):
        return self._stats


@pytest.mark.parametrize("require", [False, True])
def test_metrics_require_api_key_flag(require: bool):
    from fastapi.testclient import TestClient

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    flags = ["--metrics-require-api-key"] if require else []
    args = make_arg_parser().parse_args(flags)
    assert args.metrics_require_api_key is require
    app = build_app(_StandInEngine(), EngineConfig(model=f"org/{MODEL}"), api_key=API_KEY,
                    metrics_require_api_key=args.metrics_require_api_key)
    closed = 401 if require else 200
    key = {"Authorization": f"Bearer {API_KEY}"}
    with TestClient(app) as http:
        for path in ("/metrics", "/dashboard/data"):
            assert http.get(path).status_code == closed, path
            assert http.get(path, headers=key).status_code == 200, path
        assert http.get("/dashboard").status_code == 200  # the page holds no data
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models").status_code == 401
