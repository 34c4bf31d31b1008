"""The engine for servers: the step loop runs on its own thread; asyncio callers get streams.

Requests and aborts cross into the loop thread through a queue; outputs come back to each
caller's asyncio queue with `call_soon_threadsafe`. Validation errors of a new request are
raised in the caller (a ValueError), so an HTTP layer can answer 400 while the loop keeps
serving everyone else.

Faults stay as small as they can:
- a request the model cannot go on with (NaN logits) fails alone (`RequestFailedError`);
- a model step that raises fails the requests in that step, and the loop goes on; after
  `max_step_failures` failed steps in a row the engine is declared dead;
- any other failure of the loop (its state can no longer be trusted), or `shutdown`, ends
  every pending request with `EngineDeadError` and turns `is_healthy` False, so nothing hangs
  and new requests fail at once.
Errors meant for clients name the exception type only; the details go to the log.
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
from pagedllm.engine.llm_engine import EngineStats, LLMEngine, StepError
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it failed, or it was shut down): nothing can be served."""


class EngineShutdownError(EngineDeadError):
    """The engine was stopped on purpose (the server is shutting down)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its step raised, or its logits were not finite);
    the other requests go on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _fail(fut: concurrent.futures.Future | None, error: BaseException) -> None:
    if fut is not None:
        try:
            fut.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # answered already, or cancelled by its caller


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_step_failures: int = 3):
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_step_failures = max_step_failures
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None  # set once the loop has stopped
        self._dead = EngineDeadError("the engine is not running")
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
            raise self._dead
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._streams[request_id] = stream
        self._commands.put(("add", (request_id, prompt, prompt_token_ids, params), fut))
        if not self.is_healthy:  # the loop stopped after the check above: nobody will answer
            _fail(fut, self._dead)
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
                    finished = True  # the engine has ended it already
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

    def stop(self) -> None:
        """Ask the loop to stop after its current step, without waiting: pending requests
        then end with EngineDeadError (the server's drain deadline uses this)."""
        self._stop.set()
        self._commands.put(("wake", None, None))

    def shutdown(self) -> None:
        self.stop()
        self._thread.join(timeout=10)
        self.engine.shutdown()  # worker processes of a multi-process executor

    # ------------------------------------------------------------------ loop thread
    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody is listening
                pass

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

    def _step(self) -> None:
        for out in self.engine.step():
            if out.error is not None:
                self._deliver(out.request_id, RequestFailedError(f"generation failed: {out.error}"))
            else:
                self._deliver(out.request_id, out)

    def _fail_step(self, e: StepError, failures: int) -> None:
        """Fail the requests of a step that raised, or give up when steps keep failing."""
        cause = e.__cause__ or e
        logger.error("engine step failed (%d in a row); failing its %d requests",
                     failures, len(e.request_ids), exc_info=cause)
        if failures >= self.max_step_failures:
            raise EngineDeadError(f"{failures} engine steps failed in a row") from cause
        err = RequestFailedError(f"generation failed: the engine step running this request "
                                 f"raised {type(cause).__name__}; see the server log")
        for rid in e.request_ids:
            self.engine.abort_request(rid, "error")
            self._deliver(rid, err)

    def _loop(self) -> None:
        failures = 0
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
                    try:
                        self._step()
                        failures = 0
                    except StepError as e:
                        failures += 1
                        self._fail_step(e, failures)
                self._stats = self.engine.stats()
        except BaseException as e:  # the loop cannot continue: fail everyone, loudly
            root = e.__cause__ if isinstance(e, EngineDeadError) and e.__cause__ else e
            logger.exception("engine loop failed")
            self._end(e, EngineDeadError(f"the engine stopped after an internal error "
                                         f"({type(root).__name__}); see the server log"))
        else:
            self._end(self._dead, EngineShutdownError("the server is shutting down"))

    def _end(self, error: BaseException, client_error: EngineDeadError) -> None:
        """No more requests: answer everyone who is waiting, and whoever comes later."""
        self._dead = client_error
        self._error = error  # is_healthy is False from here on
        for rid in list(self._streams):
            self._deliver(rid, client_error)
        while True:
            try:
                _, _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            _fail(fut, client_error)
