"""What the server tells its operator while it runs: a periodic stats line, one line per
rejected request (with the reason a client was given), optional per-request lines, and the
Prometheus metrics again under vLLM's names for dashboards and autoscalers built for vLLM.

Everything here reads what the engine already keeps (its metrics registry and the last
SchedulerStats the core sent) from the server's event loop: nothing runs in the engine's
step loop, and nothing here can slow a step down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncLLM

    from .serving_engine import APIError

stats_logger = logging.getLogger("pagedllm.server.stats")
requests_logger = logging.getLogger("pagedllm.server.requests")

DEFAULT_STATS_INTERVAL = 10.0
_MAX_LOGGED_MESSAGE = 300  # characters of an error message in the log


@dataclass
class MonitoringOptions:
    """`--stats-interval` / `--disable-log-stats` (stats_interval None: no stats line),
    `--log-requests` and `--vllm-metric-names`."""

    stats_interval: float | None = DEFAULT_STATS_INTERVAL
    log_requests: bool = False
    vllm_metric_names: bool = False


# ---------------------------------------------------------------------- rejections
def log_rejection(method: str, path: str, err: APIError) -> None:
    """One line for an error answer: INFO for a client's mistake (4xx: routine, and a noisy
    client must not look like a broken server), WARNING for 5xx. The message the client got,
    cut short; never the request body."""
    message = err.message
    if len(message) > _MAX_LOGGED_MESSAGE:
        message = message[:_MAX_LOGGED_MESSAGE] + "..."
    level = logging.WARNING if err.status >= 500 else logging.INFO
    requests_logger.log(level, "%s %s -> %d: %s", method, path, err.status, message)


# ---------------------------------------------------------------------- the stats line
class StatsLogger:
    """Every `interval` seconds while the engine is busy, one line as vLLM writes it:
    prompt and generation throughput over the interval, running and waiting requests, KV
    cache usage and the prefix-cache hit rate. Quiet while idle (a server waiting for
    traffic should not fill its log); the interval after the last tokens still reports."""

    def __init__(self, engine: AsyncLLM, interval: float,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.interval = interval
        self.clock = clock
        self._last: tuple[float, ...] | None = None  # the totals at the last tick
        self._last_time = 0.0

    def _totals(self) -> tuple[float, ...]:
        """Prompt tokens, generated tokens, prefix-cache queries and hits so far."""
        metrics = self.engine.metrics
        labels = {"model_name": metrics.model_name}
        return tuple(metrics.registry.get_sample_value(f"pagedllm:{name}_total", labels) or 0.0
                     for name in ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                                  "prefix_cache_hits", "spec_decode_num_drafts",
                                  "spec_decode_num_accepted_tokens"))

    def tick(self) -> str | None:
        """The line for the interval just ended, or None if the engine was idle (or this is
        the first tick, which only takes the starting totals)."""
        now, totals = self.clock(), self._totals()
        if self._last is None:
            self._last, self._last_time = totals, now
            return None
        elapsed = max(now - self._last_time, 1e-9)
        prompt, generated, queries, hits, drafts, accepted = (
            a - b for a, b in zip(totals, self._last, strict=True))
        self._last, self._last_time = totals, now
        s = self.engine.stats()
        if not (prompt or generated or s.num_running or s.num_waiting):
            return None
        if not queries:  # no prompt looked up in this interval: the rate so far
            queries, hits = totals[2], totals[3]
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {generated / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {100.0 * s.kv_usage:.1f}%, "
                f"Prefix cache hit rate: {hit_rate:.1f}%"
                # speculative decoding: tokens a verified step gave a sequence, on average
                + (f", Mean acceptance length: {1 + accepted / drafts:.2f}" if drafts else ""))

    async def run(self) -> None:
        self.tick()  # the starting totals
        while True:
            await asyncio.sleep(self.interval)
            line = self.tick()
            if line is not None:
                stats_logger.info("%s", line)


# ---------------------------------------------------------------------- one request
def sampling_summary(p: SamplingParams) -> str:
    """The settings that explain a request's cost and output, in one short string."""
    parts = [f"n={p.n}", f"max_tokens={p.max_tokens}", f"temperature={p.temperature:g}"]
    if p.top_p < 1.0:
        parts.append(f"top_p={p.top_p:g}")
    if p.top_k > 0:
        parts.append(f"top_k={p.top_k}")
    if p.seed is not None:
        parts.append(f"seed={p.seed}")
    if p.stop:
        parts.append(f"stop={1 if isinstance(p.stop, str) else len(p.stop)}")
    if p.logprobs is not None:
        parts.append(f"logprobs={p.logprobs}")
    if p.structured_outputs is not None:
        parts.append("structured")
    return " ".join(parts)


def log_accepted(request_id: str, endpoint: str, prompt_tokens: list[int],
                 params: SamplingParams) -> None:
    """`--log-requests`: the request has passed the server's checks and goes to the engine
    (which may still refuse it: then its finished line says error)."""
    requests_logger.info("request %s accepted: %s, prompt_tokens=%d, %s", request_id, endpoint,
                         sum(prompt_tokens), sampling_summary(params))


async def logged_stream(stream: AsyncIterator[tuple[int, RequestOutput]], request_id: str,
                        started: float) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`stream`, logging one line when it ends: how it finished (an interrupted stream, a
    client that left or a deadline, shows as abort), the tokens generated, the latency."""
    latest: dict[int, RequestOutput] = {}
    failed: str | None = None
    try:
        async for i, out in stream:
            latest[i] = out
            yield i, out
    except Exception as e:
        failed = type(e).__name__
        raise
    finally:
        await stream.aclose()
        choices = [c for out in latest.values() for c in out.outputs]
        reasons = dict.fromkeys(c.finish_reason or "abort" for c in choices)
        reason = failed and f"error ({failed})" or ",".join(reasons) or "abort"
        log_finished(request_id, reason, sum(len(c.token_ids) for c in choices), started)


def log_finished(request_id: str, reason: str, completion_tokens: int, started: float) -> None:
    """`--log-requests`: the request's last line, whichever way it ended."""
    requests_logger.info("request %s finished: finish_reason=%s, completion_tokens=%d, "
                         "latency=%.3fs", request_id, reason, completion_tokens,
                         time.monotonic() - started)


# ---------------------------------------------------------------------- vLLM's names
# pagedllm's families -> vLLM's names for the same numbers (same type, unit and labels).
# kv_cache_blocks has no vLLM counterpart and is not repeated.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pagedllm:num_requests_running": ("vllm:num_requests_running",),
    "pagedllm:num_requests_waiting": ("vllm:num_requests_waiting",),
    # A fraction 0-1 in both; gpu_cache_usage_perc is the V0 name older dashboards use.
    "pagedllm:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagedllm:prompt_tokens": ("vllm:prompt_tokens",),
    "pagedllm:generation_tokens": ("vllm:generation_tokens",),
    "pagedllm:request_success": ("vllm:request_success",),
    "pagedllm:num_preemptions": ("vllm:num_preemptions",),
    "pagedllm:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "pagedllm:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "pagedllm:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # time_per_output_token_seconds is the older name of the same per-token gap.
    "pagedllm:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                             "vllm:time_per_output_token_seconds"),
    "pagedllm:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedllm:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
}


class VllmNames:
    """A collector repeating `source`'s families under vLLM's names, read at scrape time
    (so the two never disagree, and the engine updates one set of numbers)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            for name in VLLM_NAMES.get(family.name, ()):
                renamed = Metric(name, family.documentation, family.type, family.unit)
                renamed.samples = [s._replace(name=name + s.name[len(family.name):])
                                   for s in family.samples]
                yield renamed


def vllm_registry(source: CollectorRegistry) -> CollectorRegistry:
    """A registry exposing `source` under vLLM's names (for `--vllm-metric-names`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmNames(source))
    return registry
