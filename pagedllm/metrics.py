"""Prometheus metrics of one engine, named like vLLM's with our `pagedllm:` prefix.

Each engine owns its registry (several engines in one process, as in tests, never clash);
the server exposes it at /metrics. The engine loop updates it once per step, so scraping
costs the loop nothing.
"""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class BatchHistogram:
    """A Prometheus histogram fed a whole step's observations at once.

    prometheus-client's Histogram takes a lock and walks its buckets on every observe(); at
    hundreds of sequences per step that adds up in the engine loop. Here a step costs one
    searchsorted."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str):
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = np.asarray(buckets, dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values) -> None:
        if not len(values):
            return
        v = np.asarray(values, dtype=np.float64)
        idx = np.searchsorted(self.bounds, v, side="left")  # bucket i holds v <= bounds[i]
        with self._lock:
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum += float(v.sum())

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def collect(self):
        with self._lock:
            cum = np.cumsum(self.counts)
            total = self.sum
        fam = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cum[:-1], strict=True)]
        buckets.append(("+Inf", int(cum[-1])))
        fam.add_metric([self.model_name], buckets, total)
        yield fam


class EngineMetrics:
    def __init__(self, model_name: str, max_loras: int = 0):
        """`max_loras`: the engine's LoRA slots (0: LoRA off, no LoRA metric)."""
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"pagedllm:{name}", doc, lab, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"pagedllm:{name}", doc, lab, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            h = BatchHistogram(f"pagedllm:{name}", doc, buckets, model_name)
            r.register(h)
            return h

        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.kv_cache_blocks = gauge("kv_cache_blocks", "Blocks in the KV-cache pool.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter("pagedllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model = self.model_name = model_name
        self.time_to_first_token = hist("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = hist("inter_token_latency_seconds", "Time between tokens of a sequence.", _ITL_BUCKETS)
        self.e2e_request_latency = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.request_queue_time = hist("request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS)
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Sequence steps that verified speculative drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self._spec_per_pos = Counter("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Speculative draft tokens accepted, by position in the draft.",
                                     ["model_name", "position"], registry=r)
        # As vLLM's lora_requests_info: the adapters in labels, the time of the last change
        # as the value; one series (the previous one is dropped when the adapters change).
        self.max_loras = max_loras
        self._lora_info = Gauge("pagedllm:lora_requests_info", "Running and waiting LoRA "
                                "adapters (labels); the value is when they last changed.",
                                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                registry=r) if max_loras else None
        self._last_loras: tuple | None = None
        self._last_queries = self._last_hits = self._last_preemptions = 0
        self._last_spec = (0, 0, 0)
        self._last_spec_pos: list[int] = []

    def request_finished(self, reason: str) -> None:
        self._success.labels(self._model, reason).inc()

    def update_pool(self, stats) -> None:
        """Set gauges and advance cumulative counters from a SchedulerStats snapshot."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_blocks.set(stats.num_blocks)
        self.prefix_cache_queries.inc(stats.prefix_queries - self._last_queries)
        self.prefix_cache_hits.inc(stats.prefix_hits - self._last_hits)
        self.num_preemptions.inc(stats.num_preemptions - self._last_preemptions)
        self._last_queries, self._last_hits = stats.prefix_queries, stats.prefix_hits
        self._last_preemptions = stats.num_preemptions
        if self._lora_info is not None:
            loras = (",".join(stats.waiting_loras), ",".join(stats.running_loras))
            if loras != self._last_loras:
                self._lora_info.clear()
                self._lora_info.labels(str(self.max_loras), *loras).set_to_current_time()
                self._last_loras = loras
        spec = (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens)
        if spec != self._last_spec:
            for c, now, last in zip((self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
                                     self.spec_decode_num_accepted_tokens), spec, self._last_spec, strict=True):
                c.inc(now - last)
            self._last_spec = spec
            last_pos = self._last_spec_pos + [0] * (len(stats.spec_accepted_per_pos) - len(self._last_spec_pos))
            for pos, (now, last) in enumerate(zip(stats.spec_accepted_per_pos, last_pos, strict=True)):
                if now > last:
                    self._spec_per_pos.labels(self._model, str(pos)).inc(now - last)
            self._last_spec_pos = list(stats.spec_accepted_per_pos)
