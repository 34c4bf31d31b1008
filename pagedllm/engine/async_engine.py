"""The engine for servers: the step loop runs on its own thread; asyncio callers get streams.

Requests and aborts cross into the loop thread through a queue; outputs come back to each
caller's asyncio queue with `call_soon_threadsafe`. Validation errors of a new request are
raised in the caller (a ValueError), so an HTTP layer can answer 400 while the loop keeps
serving everyone else. If the loop itself fails, every pending request gets the error and
`is_healthy` turns False, so nothing hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import EngineStats, LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed and cannot serve requests any more."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="pagedllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    # ------------------------------------------------------------------ public
    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """A snapshot taken by the loop after its latest step (safe from any thread)."""
        return self._stats

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request until it finishes. Cancelling the
        consumer (e.g. a client disconnect) aborts the request and frees its blocks."""
        if not self.is_healthy:
            raise EngineDeadError(f"engine is not running: {self._error!r}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._streams[request_id] = stream
        self._commands.put(("add", (request_id, prompt, prompt_token_ids, params), fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller left while the add was queued
            self._streams.pop(request_id, None)
            self.abort(request_id)  # queued after the add, so it also undoes a late add
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ loop thread
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _handle(self, cmd, arg, fut) -> None:
        if cmd == "add":
            if not fut.set_running_or_notify_cancel():
                return  # cancelled by its caller before the loop got to it
            try:
                self.engine.add_request(*arg)
            except Exception as e:  # invalid request: tell the caller, keep serving
                fut.set_exception(e)
            else:
                fut.set_result(None)
        elif cmd == "abort":
            self.engine.abort_request(arg)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(block=block, timeout=0.5 if block else None)
                    self._handle(*cmd)
                    while True:
                        self._handle(*self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                self._stats = self.engine.stats()
        except BaseException as e:  # the loop cannot continue: fail everyone, loudly
            logger.exception("engine loop failed")
            self._error = e
            err = EngineDeadError(f"engine loop failed: {type(e).__name__}: {e}")
            for rid in list(self._streams):
                self._deliver(rid, err)
            while True:
                try:
                    _, _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if fut is not None and not fut.done():
                    fut.set_exception(err)
