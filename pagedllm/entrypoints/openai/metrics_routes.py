"""Routes for watching the server: /metrics for Prometheus, /dashboard for people.

Both show load numbers only (never prompts or outputs), so by default they are open like
/health: a scraper or an operator's browser needs no API key. `--metrics-require-api-key`
closes /metrics and the dashboard's data; the dashboard page itself stays open because it
is a static file with no data in it, and asks for the key when its data needs one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .dashboard import DashboardSampler, dashboard_html
from .monitoring import vllm_registry

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncLLM

METRICS_PATH = "/metrics"
DASHBOARD_PATH = "/dashboard"
DASHBOARD_DATA_PATH = "/dashboard/data"
# Paths that give load numbers: open unless the key is required for metrics.
METRICS_PATHS = frozenset({METRICS_PATH, DASHBOARD_DATA_PATH})

# The page loads nothing from anywhere (no CDN can be reached where servers often run);
# the policy makes the browser enforce that, and keeps the page from being framed.
_DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                               "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def engine_sampler(engine: AsyncLLM, model_name: str) -> DashboardSampler:
    """A sampler over an AsyncLLM: its stats snapshot and its metrics registry (both
    safe from the event loop thread)."""
    return DashboardSampler(lambda: engine.stats(), lambda: engine.metrics.registry,
                            model_name)


@contextlib.asynccontextmanager
async def sampling(sampler: DashboardSampler) -> AsyncIterator[None]:
    """Run the sampler in the background for as long as the server runs (a lifespan)."""
    task = asyncio.create_task(sampler.run(), name="pagedllm-dashboard-sampler")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def add_metrics_routes(app: FastAPI, engine: AsyncLLM, sampler: DashboardSampler,
                       vllm_names: bool = False) -> None:
    """GET /metrics, /dashboard and /dashboard/data on `app`. `vllm_names`: /metrics
    repeats the numbers under vLLM's names too (`--vllm-metric-names`)."""
    page = dashboard_html()  # read once: a missing file fails at startup, not per request
    vllm: list[CollectorRegistry] = []  # made at the first scrape, from the engine's registry

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics() -> Response:
        # Rendering reads the counters under their locks; it never waits on the engine loop.
        registry = engine.metrics.registry
        body = generate_latest(registry)
        if vllm_names:
            if not vllm:
                vllm.append(vllm_registry(registry))
            body += generate_latest(vllm[0])
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=_DASHBOARD_HEADERS)

    @app.get(DASHBOARD_DATA_PATH)
    async def dashboard_data() -> JSONResponse:
        """The last few minutes of KV usage, running/waiting requests, generation tokens/s
        and prefix-cache hit rate, one point a second, plus current numbers and totals."""
        return JSONResponse(sampler.data(), headers={"Cache-Control": "no-store"})
