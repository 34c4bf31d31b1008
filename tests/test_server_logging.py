"""What the server tells its operator: one log format for every line (pagedllm, uvicorn and
the engine core process), a stats line only while busy, rejected requests with their reason,
--log-requests lines, and /metrics under vLLM's names with --vllm-metric-names.

Most promises are checked in process (a stand-in engine with the real metrics registry);
one real server (SmolLM2, a subprocess) shows them together under traffic.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from test_metrics import MODEL, Scrape, Server, _StandInEngine, running_server, wait_for

from pagedllm.config import EngineConfig
from pagedllm.engine.messages import SchedulerStats
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import (
    ignored_vllm_flags,
    make_arg_parser,
    monitoring_options,
)
from pagedllm.entrypoints.openai.monitoring import (
    VLLM_NAMES,
    MonitoringOptions,
    StatsLogger,
    logged_stream,
)
from pagedllm.outputs import CompletionOutput, RequestOutput

API_KEY = "logging-key"
STATS = "Avg prompt throughput"
# time, level, logger: message -- the one format (asctime's default look).
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                  r"[\w.]+: ")


def busy_stats(running: int = 2, waiting: int = 1) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0.25, 128, 96, 0, 0, 0)


def idle_stats() -> SchedulerStats:
    return SchedulerStats(0, 0, 0.0, 128, 128, 0, 0, 0)


# ---------------------------------------------------------------------- the stats line
def test_stats_line_reports_the_interval_and_is_quiet_when_idle():
    engine = _StandInEngine()
    now = [100.0]
    stats = StatsLogger(engine, 0.5, clock=lambda: now[0])
    assert stats.tick() is None  # the starting totals
    now[0] += 0.5
    assert stats.tick() is None  # nothing ran: no line
    m = engine.metrics
    m.prompt_tokens.inc(20)
    m.generation_tokens.inc(50)
    m.prefix_cache_queries.inc(100)
    m.prefix_cache_hits.inc(40)
    engine._stats = busy_stats()
    now[0] += 0.5
    line = stats.tick()
    assert line == ("Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 100.0 "
                    "tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 40.0%")
    # Still running but no token this interval (a long prefill): still reported.
    now[0] += 1.0
    assert "Avg generation throughput: 0.0 tokens/s, Running: 2 reqs" in stats.tick()
    # The last tokens came in this interval, then nothing runs: one more line, then quiet.
    m.generation_tokens.inc(10)
    engine._stats = idle_stats()
    now[0] += 1.0
    assert "Avg generation throughput: 10.0 tokens/s, Running: 0 reqs" in stats.tick()
    now[0] += 1.0
    assert stats.tick() is None


def test_stats_flags():
    parse = make_arg_parser().parse_args
    assert monitoring_options(parse([])).stats_interval == 10.0
    assert monitoring_options(parse(["--stats-interval", "0.5"])).stats_interval == 0.5
    assert monitoring_options(parse(["--stats-interval", "0"])).stats_interval is None
    off = parse(["--stats-interval", "0.5", "--disable-log-stats"])
    assert monitoring_options(off).stats_interval is None
    assert ignored_vllm_flags(off) == []  # a real flag now, not a no-op warned about
    args = parse(["--log-requests", "--vllm-metric-names"])
    opts = monitoring_options(args)
    assert opts.log_requests and opts.vllm_metric_names
    assert not monitoring_options(parse([])).log_requests
    assert not monitoring_options(parse([])).vllm_metric_names


def app_over(engine: _StandInEngine, **options) -> TestClient:
    app = build_app(engine, EngineConfig(model=f"org/{MODEL}"), api_key=API_KEY,
                    monitoring=MonitoringOptions(**options))
    return TestClient(app, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.mark.parametrize("interval", [0.05, None])
def test_the_app_logs_stats_while_busy_unless_disabled(interval, caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.server.stats")
    engine = _StandInEngine()
    with app_over(engine, stats_interval=interval):
        time.sleep(0.3)  # idle: no line
        assert STATS not in caplog.text
        engine._stats = busy_stats()
        engine.metrics.generation_tokens.inc(5)
        time.sleep(0.3)
    if interval is None:
        assert STATS not in caplog.text
    else:
        assert "Running: 2 reqs, Waiting: 1 reqs" in caplog.text


# ---------------------------------------------------------------------- rejections
def test_rejections_are_logged_with_their_reason(caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.server.requests")
    with app_over(_StandInEngine()) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"})
        assert r.status_code == 400
        r = http.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    records = [r for r in caplog.records if r.name == "pagedllm.server.requests"]
    assert len(records) == 2, caplog.text
    bad, unauthorized = (r.getMessage() for r in records)
    assert bad.startswith("POST /v1/completions -> 400: temperature: ")
    assert "hot" not in bad  # the message the client got, not the body it sent
    assert unauthorized == ("GET /v1/models -> 401: Invalid or missing API key: send "
                            "'Authorization: Bearer <key>'.")
    assert all(r.levelno == logging.INFO for r in records)  # a client's mistake


# ---------------------------------------------------------------------- --log-requests
def _output(tokens: int, reason: str | None) -> RequestOutput:
    choice = CompletionOutput(index=0, text="x" * tokens, token_ids=list(range(tokens)),
                              cumulative_logprob=None, logprobs=None, finish_reason=reason)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[choice],
                         finished=reason is not None)


def test_a_logged_stream_says_how_it_ended(caplog):
    caplog.set_level(logging.INFO, logger="pagedllm.server.requests")

    async def engine_stream():
        for n in (1, 2, 3):
            yield 0, _output(n, "stop" if n == 3 else None)

    async def consume(limit: int) -> None:
        stream = logged_stream(engine_stream(), "req-1", time.monotonic())
        async for i, _ in stream:
            if i + 1 >= limit:
                break
        await stream.aclose()

    asyncio.run(consume(limit=10))
    assert re.search(r"request req-1 finished: finish_reason=stop, completion_tokens=3, "
                     r"latency=\d+\.\d{3}s$", caplog.records[-1].getMessage())
    asyncio.run(consume(limit=1))  # the client left after the first chunk
    assert "finish_reason=abort, completion_tokens=1," in caplog.records[-1].getMessage()


# ---------------------------------------------------------------------- vLLM's names
@pytest.mark.parametrize("flag", [True, False])
def test_vllm_metric_names_only_with_the_flag(flag: bool):
    engine = _StandInEngine()
    m = engine.metrics
    m.generation_tokens.inc(7)
    m.request_finished("length")
    m.e2e_request_latency.observe(0.3)
    m.inter_token_latency.observe_many([0.01, 0.02])
    m.update_pool(SchedulerStats(3, 1, 0.5, 128, 64, 10, 4, 2))
    with app_over(engine, vllm_metric_names=flag) as http:
        scraped = Scrape(http.get("/metrics").text)
    names = {n for n in scraped.families if n.startswith("vllm:") and not n.endswith("_created")}
    if not flag:
        assert names == set()
        return
    ours = {n.removeprefix("pagedllm:"): f for n, f in scraped.families.items()
            if n.startswith("pagedllm:")}
    expected = {v for vs in VLLM_NAMES.values() for v in vs}
    assert names == expected
    for source, targets in VLLM_NAMES.items():
        family = ours[source.removeprefix("pagedllm:")]
        for target in targets:
            twin = scraped.families[target]
            assert twin.type == family.type, target
            assert [(s.name.replace(target, source), s.labels, s.value) for s in twin.samples
                    if not s.name.endswith("_created")] == \
                [(s.name, s.labels, s.value) for s in family.samples
                 if not s.name.endswith("_created")]
    assert {f.type for n, f in scraped.families.items() if n in (
        "vllm:num_requests_running", "vllm:gpu_cache_usage_perc")} == {"gauge"}
    assert scraped.families["vllm:time_per_output_token_seconds"].type == "histogram"
    assert scraped.value("vllm:num_requests_running") == 3
    assert scraped.value("vllm:gpu_cache_usage_perc") == 0.5
    assert scraped.value("vllm:generation_tokens_total") == 7
    assert scraped.value("vllm:prefix_cache_hits_total") == 4
    assert scraped.value("vllm:num_preemptions_total") == 2
    assert scraped.value("vllm:request_success_total", finished_reason="length") == 1
    assert scraped.value("vllm:inter_token_latency_seconds_count") == 2
    assert scraped.value("vllm:e2e_request_latency_seconds_count") == 1


# ---------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    flags = ["--log-level", "info", "--stats-interval", "0.5", "--log-requests",
             "--vllm-metric-names"]
    with running_server(tmp_path_factory.mktemp("logging"), *flags) as s:
        yield s


def stats_lines(server: Server) -> list[str]:
    return [line for line in server.log.read_text().splitlines() if STATS in line]


def test_a_real_server_logs_in_one_format_under_traffic(server: Server):
    scrape = lambda: Scrape(httpx.get(f"{server.url}/metrics", timeout=30).text)  # noqa: E731
    before = scrape()
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Count: one, two,",
                                               "max_tokens": 24, "ignore_eos": True,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                      "max_tokens": 5000})
        assert too_long.status_code == 400
    after = scrape()
    # vLLM's names move with traffic, and agree with ours.
    for name, labels in [("generation_tokens_total", {}), ("prompt_tokens_total", {}),
                         ("request_success_total", {"finished_reason": "length"}),
                         ("e2e_request_latency_seconds_count", {}),
                         ("time_to_first_token_seconds_count", {})]:
        moved = after.value(f"vllm:{name}", **labels) - before.value(f"vllm:{name}", **labels)
        assert moved > 0, name
        assert after.value(f"vllm:{name}", **labels) == after.value(f"pagedllm:{name}", **labels)
    assert after.value("vllm:generation_tokens_total") - \
        before.value("vllm:generation_tokens_total") == usage["completion_tokens"]

    # Stats lines came while it ran, with tokens in them; then the idle server is quiet.
    lines = wait_for(lambda: stats_lines(server), "a stats line")
    assert any(not re.search(r"Avg generation throughput: 0\.0 ", line) for line in lines), lines
    time.sleep(1.5)  # three intervals: the last busy one has been logged
    quiet = len(stats_lines(server))
    time.sleep(1.5)
    assert len(stats_lines(server)) == quiet

    log = server.log.read_text()
    assert "POST /v1/completions -> 400: This model's maximum context length is" in log
    accepted = re.search(r"request (cmpl-\w+) accepted: /v1/completions, prompt_tokens=(\d+), "
                         r"n=1 max_tokens=24 temperature=0\b", log)
    assert accepted, log[-3000:]
    assert int(accepted[2]) == usage["prompt_tokens"]
    assert re.search(rf"request {accepted[1]} finished: finish_reason=length, "
                     rf"completion_tokens=24, latency=\d+\.\d+s", log), log[-3000:]

    # Every line but the start-up banner (printed, not logged) has the one format; uvicorn's
    # error and access loggers are among them.
    banner = re.compile(r"^(pagedllm \S+: serving |  \w)")
    for line in log.splitlines():
        assert LINE.match(line) or banner.match(line), line
    assert re.search(r"INFO uvicorn\.error: Application startup complete", log)
    assert re.search(r'INFO uvicorn\.access: 127\.0\.0\.1:\d+ - "POST /v1/completions '
                     r'HTTP/1\.1" 400', log)
