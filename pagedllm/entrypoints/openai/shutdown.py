"""Graceful shutdown: the first SIGTERM (or Ctrl-C) starts a drain instead of an exit.

While draining, new requests get 503 (code `shutting_down`, with `Connection: close`), and
so does the readiness probe /ready, so a load balancer stops sending more; the requests
already running go on to their end. The liveness probe /health stays 200: the process is
alive and finishing its work, and a supervisor that restarted it would cut those requests.
When none is left, or `--shutdown-timeout` seconds have passed, the server stops: whatever
still runs at the deadline is ended with an error (a 503, or a stream's last event), the
listening socket closes, and the process exits 0. A second signal ends the drain at once.
/metrics stays readable while draining.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from .limits import refuse
from .serving_engine import APIError

logger = logging.getLogger("pagedllm.server")


class Drain:
    """The drain's state, shared by the middleware (which counts requests in flight) and
    the server (which decides when to stop). Both run on the event loop's thread."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.started: float | None = None
        self.forced = False
        self.in_flight = 0

    @property
    def draining(self) -> bool:
        return self.started is not None

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def expired(self) -> bool:
        return self.forced or (self.started is not None
                               and time.monotonic() - self.started >= self.timeout)


def route_path(scope: Scope) -> str:
    """The path the routes see: without --root-path's prefix when a proxy passed it on, so
    the open paths (/health, /metrics) stay open behind a proxy that does not strip it."""
    path, prefix = scope["path"], scope.get("root_path", "")
    if prefix and path.startswith(prefix + "/"):
        return path[len(prefix):]
    return path


class DrainMiddleware:
    """Counts the HTTP requests in flight; refuses new ones once the drain has begun."""

    def __init__(self, app: ASGIApp, drain: Drain, open_paths: frozenset[str] = frozenset()):
        self.app = app
        self.drain = drain
        self.open_paths = open_paths  # still served while draining (liveness, metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and route_path(scope) not in self.open_paths:
            await refuse(scope, receive, send, APIError(
                "the server is shutting down; retry on another replica", 503,
                code="shutting_down", headers={"Retry-After": "1"}))
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM/SIGINT starting a drain. `on_deadline` is called when
    the drain time is up with requests still running (it should end them: the engine's
    `stop`, which fails their streams, so their handlers return)."""

    # After the engine died: how long the requests it failed have to send their 503s.
    DEAD_ENGINE_GRACE_S = 1.0

    def __init__(self, config: uvicorn.Config, drain: Drain, on_deadline: Callable[[], None]):
        super().__init__(config)
        self.drain = drain
        self.on_deadline = on_deadline
        self.engine_died_at: float | None = None

    def engine_died(self) -> None:
        """The engine cannot serve any more (from any thread): answer 503 for a moment,
        then stop; `run_server` then exits non-zero, so a supervisor restarts it."""
        if self.engine_died_at is None:
            self.engine_died_at = time.monotonic()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # The signal is not recorded as uvicorn does: uvicorn re-raises recorded signals
        # after shutting down, and the process would then die by SIGTERM instead of exit 0.
        if self.drain.draining:
            logger.warning("second %s: ending the drain now", signal.Signals(sig).name)
            self.drain.forced = True
            return
        logger.warning("%s: draining; new requests get 503, running ones have up to %g s",
                       signal.Signals(sig).name, self.drain.timeout)
        self.drain.start()

    async def on_tick(self, counter: int) -> bool:
        drain = self.drain
        died = self.engine_died_at
        if died is not None and not self.should_exit and time.monotonic() - died > self.DEAD_ENGINE_GRACE_S:
            logger.error("the engine has stopped: shutting the server down")
            self.should_exit = True
        if drain.draining and not self.should_exit:
            if drain.in_flight == 0:
                logger.info("drained: no request is running")
                self.should_exit = True
            elif drain.expired():
                logger.warning("drain time is up: ending %d running requests", drain.in_flight)
                self.on_deadline()
                self.should_exit = True
        return await super().on_tick(counter)
