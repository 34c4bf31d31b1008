"""The live dashboard's data: a once-a-second sample of the engine kept in a ring buffer.

Prometheus answers "how was the server doing" only where someone runs Prometheus; the
dashboard answers "how is it doing right now" with nothing but a browser. The server, not
the page, keeps the history, so a page opened late (or reloaded) still shows the last few
minutes, and any number of open pages cost the engine nothing more than one sampler does.

Counters are read from the engine's Prometheus registry, the very numbers /metrics
exports, so the page and a scraper never disagree; gauges come from the engine's stats
snapshot, which the loop thread refreshes after every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from prometheus_client import CollectorRegistry

from pagedllm.engine.messages import SchedulerStats

logger = logging.getLogger(__name__)

# prometheus_client's sample names (counters get `_total`) of what the dashboard shows.
_PROMPT_TOKENS = "pagedllm:prompt_tokens_total"
_GENERATION_TOKENS = "pagedllm:generation_tokens_total"
_PREFIX_QUERIES = "pagedllm:prefix_cache_queries_total"
_PREFIX_HITS = "pagedllm:prefix_cache_hits_total"
_PREEMPTIONS = "pagedllm:num_preemptions_total"
_SUCCESS = "pagedllm:request_success_total"


@dataclass(frozen=True)
class Point:
    """One sample. Counters are cumulative; rates are taken against earlier points."""

    t: float  # wall clock (the page labels its time axis by it)
    mono: float  # monotonic clock (rates; immune to clock steps)
    kv_usage: float
    running: int
    waiting: int
    generation_tokens: float
    prefix_queries: float
    prefix_hits: float
    gen_tokens_per_s: float | None  # None for the first point: no interval yet
    prefix_hit_rate: float | None  # None when no prompt tokens were looked up in the window


def read_counters(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, int]]:
    """The counters above by sample name, and finished requests by reason, in one pass
    over the registry (`get_sample_value` would collect every metric once per name)."""
    wanted = {_PROMPT_TOKENS, _GENERATION_TOKENS, _PREFIX_QUERIES, _PREFIX_HITS, _PREEMPTIONS}
    values: dict[str, float] = {}
    reasons: dict[str, int] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in wanted:
                values[s.name] = values.get(s.name, 0.0) + s.value
            elif s.name == _SUCCESS:
                reason = s.labels.get("finished_reason", "")
                reasons[reason] = reasons.get(reason, 0) + int(s.value)
    return values, reasons


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


class DashboardSampler:
    """Samples `stats()` and `registry()` every `interval` seconds into a ring buffer of
    `capacity` points (300 at 1 s: the last five minutes).

    Both sources are callables so the engine is looked up when sampling, not when the app
    is built: an app over a stand-in engine (tests of the HTTP layer) builds fine and its
    sampler simply stops at the first sample it cannot take."""

    def __init__(self, stats: Callable[[], SchedulerStats], registry: Callable[[], CollectorRegistry],
                 model_name: str, capacity: int = 300, interval: float = 1.0,
                 hit_rate_window: int = 10):
        if capacity < 2 or interval <= 0 or hit_rate_window < 1:
            raise ValueError("capacity >= 2, interval > 0 and hit_rate_window >= 1 are required")
        self._stats, self._registry = stats, registry
        self.model_name = model_name
        self.capacity, self.interval, self.hit_rate_window = capacity, interval, hit_rate_window
        self.points: deque[Point] = deque(maxlen=capacity)
        self._latest_stats: SchedulerStats | None = None
        self._latest_counters: dict[str, float] = {}
        self._latest_reasons: dict[str, int] = {}

    def sample(self, mono: float | None = None, wall: float | None = None) -> Point:
        """Take one point now (or at the given clocks, for tests) and append it."""
        mono = time.monotonic() if mono is None else mono
        wall = time.time() if wall is None else wall
        stats = self._stats()
        counters, reasons = read_counters(self._registry())
        gen = counters.get(_GENERATION_TOKENS, 0.0)
        queries = counters.get(_PREFIX_QUERIES, 0.0)
        hits = counters.get(_PREFIX_HITS, 0.0)
        tps = None
        if self.points:
            prev = self.points[-1]
            dt = mono - prev.mono
            tps = max(0.0, gen - prev.generation_tokens) / dt if dt > 0 else prev.gen_tokens_per_s
        # The hit rate of the last `hit_rate_window` intervals: a per-second ratio would be
        # undefined most of the time (prompts arrive in bursts) and a lifetime ratio stops
        # moving after a while; the lifetime ratio is in the totals.
        n = len(self.points)
        base = self.points[-min(n, self.hit_rate_window)] if n else None
        rate = (_ratio(hits - base.prefix_hits, queries - base.prefix_queries)
                if base is not None else _ratio(hits, queries))
        point = Point(wall, mono, stats.kv_usage, stats.num_running, stats.num_waiting,
                      gen, queries, hits, tps, rate)
        self.points.append(point)
        self._latest_stats, self._latest_counters = stats, counters
        self._latest_reasons = reasons
        return point

    async def run(self) -> None:
        """Sample on a fixed beat until cancelled. A failing sample stops the sampler (and
        only the sampler: the dashboard goes stale, serving goes on)."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                self.sample()
            except Exception as e:
                logger.warning("dashboard sampling stopped: %s: %s", type(e).__name__, e)
                return
            next_at += self.interval
            now = loop.time()
            if next_at < now:  # the loop was blocked for a while: skip, do not catch up
                next_at = now + self.interval
            await asyncio.sleep(next_at - now)

    def data(self) -> dict:
        """What the page polls: the series as columns (compact, and what a plot wants),
        the latest point's numbers, and lifetime totals."""
        if not self.points:  # sampler not running (e.g. no lifespan): answer with one now
            self.sample()
        pts = list(self.points)
        last, stats, c = pts[-1], self._latest_stats, self._latest_counters
        assert stats is not None
        queries, hits = c.get(_PREFIX_QUERIES, 0.0), c.get(_PREFIX_HITS, 0.0)
        return {
            "model": self.model_name,
            "interval_s": self.interval,
            "capacity": self.capacity,
            "hit_rate_window_s": self.hit_rate_window * self.interval,
            "series": {
                "t": [round(p.t, 3) for p in pts],
                "kv_usage": [round(p.kv_usage, 4) for p in pts],
                "running": [p.running for p in pts],
                "waiting": [p.waiting for p in pts],
                "gen_tokens_per_s": [_round(p.gen_tokens_per_s, 2) for p in pts],
                "prefix_hit_rate": [_round(p.prefix_hit_rate, 4) for p in pts],
            },
            "current": {
                "t": round(last.t, 3),
                "kv_usage": round(last.kv_usage, 4),
                "kv_blocks_used": stats.num_blocks - stats.num_free_blocks,
                "num_blocks": stats.num_blocks,
                "running": last.running,
                "waiting": last.waiting,
                "gen_tokens_per_s": _round(last.gen_tokens_per_s, 2),
                "prefix_hit_rate": _round(last.prefix_hit_rate, 4),
            },
            "totals": {
                "prompt_tokens": int(c.get(_PROMPT_TOKENS, 0.0)),
                "generation_tokens": int(c.get(_GENERATION_TOKENS, 0.0)),
                "requests_finished": dict(self._latest_reasons),
                "preemptions": int(c.get(_PREEMPTIONS, 0.0)),
                "prefix_cache_queries": int(queries),
                "prefix_cache_hits": int(hits),
                "prefix_hit_rate": _round(_ratio(hits, queries), 4),
            },
        }


def dashboard_html() -> str:
    """The page: one self-contained file (inline CSS, JS and SVG), shipped as package data
    so it can be edited as HTML rather than as a Python string."""
    return resources.files(__package__).joinpath("static/dashboard.html").read_text("utf-8")
