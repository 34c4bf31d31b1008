"""GET /dashboard: the sampler's arithmetic, the data the page polls, and the page itself
rendered by headless Chromium while long requests stream through a real server."""

from __future__ import annotations

import re
import struct
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from test_metrics import MODEL, NUM_BLOCKS, Server, running_server, wait_for

from pagedllm.engine.messages import SchedulerStats
from pagedllm.entrypoints.openai.dashboard import DashboardSampler
from pagedllm.metrics import EngineMetrics

CHROMIUM = "/usr/bin/chromium"
NUM_STREAMS = 3
# The numbers the page shows as text, by element id (each also has a data-value).
VALUE_IDS = ["kv-usage", "num-running", "num-waiting", "gen-tps", "hit-rate",
             "requests-finished", "preemptions"]


# ---------------------------------------------------------------------- the sampler alone
def test_sampler_rates_window_and_ring():
    metrics = EngineMetrics("m")
    state = {"queries": 0, "hits": 0, "running": 2}

    def stats() -> SchedulerStats:
        return SchedulerStats(state["running"], 1, 0.25, 100, 75, state["queries"], state["hits"], 0)

    def sample(mono: float):
        metrics.update_pool(stats())  # what the engine loop does each step
        return sampler.sample(mono=mono, wall=1000 + mono)

    sampler = DashboardSampler(stats, lambda: metrics.registry, "m", capacity=5,
                               hit_rate_window=3)
    first = sample(0)
    assert first.gen_tokens_per_s is None and first.prefix_hit_rate is None  # nothing yet
    metrics.generation_tokens.inc(50)
    state.update(queries=100, hits=40)
    second = sample(2)
    assert second.gen_tokens_per_s == 25  # 50 tokens in 2 s
    assert second.prefix_hit_rate == pytest.approx(0.4)
    state.update(queries=200, hits=140)
    assert sample(3).prefix_hit_rate == pytest.approx(140 / 200)  # window reaches back to 0
    assert sample(4).prefix_hit_rate == pytest.approx(140 / 200)
    assert sample(5).prefix_hit_rate == pytest.approx(100 / 100)  # 3 intervals: since t=2
    assert sample(6).prefix_hit_rate is None  # no prompt looked up since t=3
    quiet = sample(7)
    assert quiet.prefix_hit_rate is None
    assert quiet.gen_tokens_per_s == 0
    assert len(sampler.points) == 5  # the ring keeps the newest `capacity` points

    metrics.request_finished("stop")
    metrics.request_finished("stop")
    metrics.request_finished("length")
    sample(8)
    d = sampler.data()
    series = d["series"]
    assert series["t"] == [1004, 1005, 1006, 1007, 1008]
    assert {len(v) for v in series.values()} == {5}
    assert series["running"] == [2] * 5 and series["kv_usage"] == [0.25] * 5
    assert d["current"] == {"t": 1008, "kv_usage": 0.25, "kv_blocks_used": 25, "num_blocks": 100,
                            "running": 2, "waiting": 1, "gen_tokens_per_s": 0.0,
                            "prefix_hit_rate": None}
    assert d["totals"] == {"prompt_tokens": 0, "generation_tokens": 50,
                           "requests_finished": {"stop": 2, "length": 1}, "preemptions": 0,
                           "prefix_cache_queries": 200, "prefix_cache_hits": 140,
                           "prefix_hit_rate": 0.7}


def test_sampler_stops_quietly_on_a_broken_engine(caplog):
    import asyncio

    def broken() -> SchedulerStats:
        raise RuntimeError("no stats here")

    sampler = DashboardSampler(broken, lambda: EngineMetrics("m").registry, "m")
    asyncio.run(asyncio.wait_for(sampler.run(), timeout=5))  # returns instead of raising
    assert "dashboard sampling stopped" in caplog.text


# ---------------------------------------------------------------------- a real server
@dataclass
class Streams:
    """Long streaming completions, each read on its own thread until stopped."""

    server: Server
    count: int

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.tokens = [0] * self.count
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True)
                        for i in range(self.count)]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        body = {"model": MODEL, "prompt": f"Story number {i}: once upon a time",
                "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with self.server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if self.stop.is_set():
                    return  # leaving the stream aborts the request
                if line.startswith("data:"):
                    self.tokens[i] += 1

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def dashboard_data(server: Server) -> dict:
    r = httpx.get(f"{server.url}/dashboard/data", timeout=30)  # open by default
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server: Server) -> dict:
    def check() -> dict | None:
        d = dashboard_data(server)
        c = d["current"]
        return d if c["running"] == c["waiting"] == c["kv_blocks_used"] == 0 else None
    return wait_for(check, "the dashboard to show an idle engine")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("dashboard")) as s:
        yield s


def test_page_is_self_contained(server: Server):
    r = httpx.get(f"{server.url}/dashboard")  # no key: the page is static
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = r.text
    # Nothing to fetch from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert not re.search(r"@import|url\(|<link[^>]+stylesheet|<script[^>]+src", page, re.I)
    for element_id in [*VALUE_IDS, "status", "chart-kv", "chart-requests", "chart-tps",
                       "chart-hit"]:
        assert f'id="{element_id}"' in page, element_id


def test_data_follows_the_engine(server: Server):
    streams = Streams(server, 1)
    try:
        busy = wait_for(lambda: (d := dashboard_data(server))["current"]["running"] == 1 and d,
                        "the dashboard to show the running request")
        assert 0 < busy["current"]["kv_usage"] <= 1
        assert busy["current"]["kv_blocks_used"] > 0 and busy["current"]["num_blocks"] == NUM_BLOCKS
        rate = wait_for(lambda: dashboard_data(server)["current"]["gen_tokens_per_s"],
                        "a generation rate")
        assert rate > 0
    finally:
        streams.close()
    d = wait_idle(server)
    series = d["series"]
    assert d["model"] == MODEL and d["capacity"] == 300 and d["interval_s"] == 1
    assert len({len(v) for v in series.values()}) == 1
    t = series["t"]
    assert len(t) >= 3 and all(0.5 < b - a < 3 for a, b in zip(t, t[1:], strict=False))
    assert max(series["running"]) == 1 and max(series["kv_usage"]) > 0
    assert series["running"][-1] == 0 and series["kv_usage"][-1] == 0
    assert d["totals"]["requests_finished"].get("abort", 0) >= 1
    assert d["totals"]["generation_tokens"] >= streams.tokens[0]


# ---------------------------------------------------------------------- in a browser
class _Values(HTMLParser):
    """data-value and text of the elements with the ids we read, plus the status line."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, str] = {}
        self.text: dict[str, str] = {}
        self.status: dict[str, str | None] = {}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id") in VALUE_IDS:
            self.values[a["id"]] = a.get("data-value") or ""
            self._open = a["id"]
        elif a.get("id") == "status":
            self.status = a

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self.text[self._open] = self.text.get(self._open, "") + data

    def handle_endtag(self, tag: str) -> None:
        self._open = None


@dataclass
class Rendered:
    dom: str
    png: Path
    values: dict[str, str]
    text: dict[str, str]
    status: dict[str, str | None]


@pytest.fixture(scope="module")
def rendered(server: Server, tmp_path_factory) -> Rendered:
    """The page as Chromium renders it while NUM_STREAMS long requests stream: its DOM
    after the scripts ran (the numbers) and a screenshot (the charts), from one run."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    wait_idle(server)
    out = tmp_path_factory.mktemp("chromium")
    png = out / "dashboard.png"
    streams = Streams(server, NUM_STREAMS)
    try:
        # A few seconds of history, so the charts have lines and the rate is known (on a
        # loaded 2-core machine a one-second sample can see no token: wait for one that did).
        # The page then fetches samples of its own; if the one it shows saw no token either
        # (a step longer than the interval), it is rendered again, up to three times.
        for _attempt in range(3):
            wait_for(lambda: (d := dashboard_data(server))["current"]["running"] == NUM_STREAMS
                     and d["series"]["running"][-4:] == [NUM_STREAMS] * 4
                     and d["current"]["gen_tokens_per_s"] > 0,
                     "the dashboard to show every stream for a few seconds", timeout=60)
            cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                   "--no-first-run", "--disable-background-networking", "--disable-component-update",
                   "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
                   f"--user-data-dir={out / 'profile'}", f"--screenshot={png}", "--dump-dom",
                   "--window-size=1200,900", "--virtual-time-budget=3000",
                   f"{server.url}/dashboard"]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=out)
            assert run.returncode == 0, run.stderr[-3000:]
            parser = _Values()
            parser.feed(run.stdout)
            if float(parser.values.get("gen-tps") or 0) > 0:
                break
    finally:
        streams.close()
    return Rendered(run.stdout, png, parser.values, parser.text, parser.status)


def test_page_shows_live_numbers(rendered: Rendered):
    assert rendered.status.get("data-state") == "live", rendered.status
    assert int(rendered.status.get("data-samples") or 0) >= 4
    v = {k: float(x) if x else None for k, x in rendered.values.items()}
    assert set(v) == set(VALUE_IDS)
    assert v["num-running"] == NUM_STREAMS and rendered.text["num-running"] == str(NUM_STREAMS)
    assert v["num-waiting"] == 0
    assert 0 < v["kv-usage"] <= 1 and rendered.text["kv-usage"].endswith("%")
    assert v["gen-tps"] > 0 and rendered.text["gen-tps"] != "\u2013"
    assert v["preemptions"] == 0
    # Each chart drew a line (an SVG path with points in it).
    for chart in ("chart-kv", "chart-requests", "chart-tps"):
        svg = re.search(rf'<svg id="{chart}".*?</svg>', rendered.dom, re.S)
        assert svg and re.search(r'<path[^>]* d="M[\d.]+,[\d.]+L', svg.group(0)), chart


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_screenshot_is_not_blank(rendered: Rendered):
    assert rendered.png.exists()
    assert _png_size(rendered.png) == (1200, 900)
    # A blank page compresses to a few kB; text, tiles and four charts do not.
    assert rendered.png.stat().st_size > 20_000


def test_screenshot_shows_the_charts(rendered: Rendered):
    image = pytest.importorskip("PIL.Image", reason="pixel checks need Pillow")
    with image.open(rendered.png) as im:
        rgb = im.convert("RGB")
    assert len(rgb.getcolors(maxcolors=1 << 20) or []) > 50  # far from blank
    # Below the tiles (whose borders have the same colours), the lines of the charts: a few
    # seconds of running requests (green) and tokens/s (violet) and, near 0%, KV use (blue).
    charts = rgb.crop((0, 200, 1200, 900))
    count = {color: n for n, color in charts.getcolors(maxcolors=1 << 20) or []}
    assert count.get((0x16, 0xA3, 0x4A), 0) > 30, "running"
    assert count.get((0x7C, 0x3A, 0xED), 0) > 30, "tokens/s"
    assert count.get((0x25, 0x63, 0xEB), 0) > 0, "KV cache"
