"""The engine for servers: the front end in the server's process, the core on its own.

`AsyncLLM` tokenizes and checks a request in the caller (a ValueError there lets an HTTP
layer answer 400 while everyone else is served), sends the core its sequences, and turns
the core's per-step deltas into cumulative `RequestOutput`s on each caller's asyncio
queue. The core runs in a process of its own (`serve`), or on a thread of this process
(`in_process=True`: tests that reach into the core).

Faults stay as small as they can:
- a request the model cannot go on with (NaN logits) fails alone (`RequestFailedError`);
- a model step that raises fails the requests in that step, and the core goes on; after
  `max_step_failures` failed steps in a row the engine is declared dead;
- any other failure of the core (its state can no longer be trusted), its process dying,
  or `shutdown`, ends every pending request with `EngineDeadError` and turns `is_healthy`
  False, so nothing hangs and new requests fail at once. `on_dead` callbacks learn of it
  (the server then exits non-zero).
Errors meant for clients name the exception type only; the details go to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.core import load_model_config
from pagedllm.engine.core_client import InprocClient, MPClient
from pagedllm.engine.llm_engine import load_frontend
from pagedllm.engine.messages import AbortRequests, AddRequest, EngineCoreOutputs, SchedulerStats
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.heap import freeze_startup_heap, thaw_heap
from pagedllm.lora_request import LoRARequest
from pagedllm.metrics import EngineMetrics
from pagedllm.model_source import resolve_source
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine has stopped (it failed, or it was shut down): nothing can be served."""


class EngineShutdownError(EngineDeadError):
    """The engine was stopped on purpose (the server is shutting down)."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (its step raised, or its logits were not finite);
    the other requests go on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


class AsyncLLM:
    def __init__(self, config: EngineConfig, in_process: bool = False, max_step_failures: int = 3):
        thaw_heap()  # an earlier engine's frozen garbage goes before this one sizes its pool
        self.max_step_failures = max_step_failures
        self._lock = threading.Lock()  # the output processor and the streams
        self._streams: dict[str, _Stream] = {}
        self._dead: EngineDeadError | None = None  # set once the engine has stopped
        self._on_dead: list[Callable[[], None]] = []
        self._stats: SchedulerStats | None = None
        self.output_processor: OutputProcessor | None = None
        if in_process:
            self.config, _, hf_config = load_model_config(config)
            self.client = InprocClient(self.config, self._on_core_outputs, max_step_failures)
        else:
            self.config, hf_config = self._start_core(config)
        self.metrics = EngineMetrics(self.config.model_name,
                                     self.config.max_loras if self.config.enable_lora else 0)
        try:
            self.tokenizer, self.processor = load_frontend(self.config, self.client.info, hf_config)
        except BaseException:
            self.client.shutdown()
            raise
        if self.core is not None:  # its grammars compile with our tokenizer (one cache)
            self.core.use_tokenizer(self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.metrics.update_pool(self.stats())
        self.max_model_len = self.config.max_model_len
        freeze_startup_heap("front end")  # pagedllm/heap.py: why

    def _start_core(self, config: EngineConfig) -> tuple[EngineConfig, object]:
        """Start the core's process, then read the model's config here while it loads: the
        imports behind transformers' config classes take seconds in each process, and they
        now overlap. Both processes resolve the same EngineConfig from the same files and
        settings (load_model_config); the checkpoint is located (downloaded, for a hub id)
        once, here, before the core starts."""
        source = resolve_source(config.model, config.load_format, config.revision,
                                config.download_dir)
        self.client = MPClient(config, self._on_core_outputs, self.max_step_failures,
                               self._on_core_death)
        try:
            resolved, _, hf_config = load_model_config(config, source)
        except BaseException:
            # The core resolves the same config and fails the same way: let it end its start
            # (it reads no command before), then stop it.
            with contextlib.suppress(BaseException):
                self.client.wait_ready()
            self.client.shutdown()
            raise
        try:
            info = self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        if info.max_model_len != resolved.max_model_len:  # a difference would be a bug
            self.client.shutdown()
            raise RuntimeError(f"the engine core resolved max_model_len {info.max_model_len}, "
                               f"the front end {resolved.max_model_len}")
        return resolved, hf_config

    # ------------------------------------------------------------------ public
    @property
    def core(self):
        """The EngineCore, when it runs in this process (None when it has its own)."""
        return self.client.core

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.client.alive()

    def describe(self) -> dict:
        return self.client.info.describe

    def stats(self) -> SchedulerStats:
        """The pool and queue as the core last reported them (safe from any thread)."""
        if self._stats is None:
            d = self.client.info.describe
            return SchedulerStats(0, 0, 0.0, d["kv_blocks"], d["kv_blocks"], 0, 0, 0)
        return self._stats

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        """Called once, from a background thread, when the engine stops unplanned."""
        self._on_dead.append(callback)

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                       params: SamplingParams, lora_request: LoRARequest | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs of one request until it finishes (a consumer slower
        than the engine gets the latest, skipping those in between). Cancelling the
        consumer (e.g. a client disconnect) aborts the request and frees its blocks."""
        self._check_alive()
        if params.structured_outputs is None:
            ids, seq_params, requests = self.processor.process(request_id, prompt,
                                                               prompt_token_ids, params, lora_request)
        else:  # checking the constraint compiles it: seconds, maybe, and not on the loop
            ids, seq_params, requests = await asyncio.to_thread(
                self.processor.process, request_id, prompt, prompt_token_ids, params, lora_request)
        run = self._run(request_id, requests, lambda: self.output_processor.add(
            request_id, prompt, ids, seq_params, requests[0].arrival_time))
        async with contextlib.aclosing(run):  # closing this stream aborts the request now
            async for out in run:
                yield out

    async def encode(self, request_id: str, prompt: str | None,
                     prompt_token_ids: list[int] | None, params: PoolingParams | None = None,
                     truncate_prompt_tokens: int | None = None) -> EmbeddingRequestOutput:
        """One embedding: a pooling request, batched in the core's steps with everyone
        else's. ValueError (before anything is queued) for an input the model cannot take."""
        self._check_alive()
        ids, request = self.processor.process_pooling(request_id, prompt, prompt_token_ids,
                                                      params, truncate_prompt_tokens)
        final = None
        run = self._run(request_id, [request], lambda: self.output_processor.add_pooling(
            request_id, prompt, ids, request.pooling_params, request.arrival_time))
        async with contextlib.aclosing(run):
            async for out in run:
                final = out
        return final

    def _check_alive(self) -> None:
        if self._dead is None and not self.client.alive():
            # Gone before its watcher said so: the same death, with the same reason.
            self._on_core_death(self.client.exit_reason())
        if self._dead is not None:
            raise self._dead

    async def _run(self, request_id: str, requests: list, register: Callable[[], None]
                   ) -> AsyncIterator:
        """Send a request's core requests and stream its outputs (`register` adds it to the
        output processor, under the lock)."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams or request_id in self.output_processor:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            register()
        try:
            for req in requests:
                self.client.send(AddRequest(req))
        except RuntimeError:  # the core is gone: the same death its watcher reports
            self._on_core_death(self.client.exit_reason())
        if self._dead is not None:  # it stopped meanwhile: nobody else will answer
            self._deliver(request_id, self._dead)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: a consumer that fell behind takes the latest one
                # (one SSE event for several tokens) instead of working through each.
                while not (isinstance(item, BaseException) or item.finished or stream.queue.empty()):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # the engine has ended it already
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self.output_processor:
                return
            seq_ids = self.output_processor.seq_ids(request_id)
            self.output_processor.abort(request_id)
        if self.is_healthy:
            with contextlib.suppress(RuntimeError):  # a core that is gone holds nothing
                self.client.send(AbortRequests(seq_ids))

    def stop(self) -> None:
        """Stop the engine after its current step, without waiting: pending requests end
        with EngineShutdownError (the server's drain deadline uses this)."""
        self._end(EngineShutdownError("the server is shutting down"))
        self.client.stop()

    def shutdown(self) -> None:
        self.stop()
        self.client.shutdown()
        thaw_heap()  # what the engine held can be collected (pagedllm/heap.py)

    # ------------------------------------------------------------------ the core's side
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_many([(request_id, item)])

    def _deliver_many(self, items: list[tuple[str, object]]) -> None:
        """Hand items to their callers' queues: one wake-up per event loop for a whole
        step (waking a loop from another thread writes to its self-pipe, a system call:
        once per stream and step was a large share of the server's time)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # its event loop is closed: nobody is listening
                pass

    def _on_core_outputs(self, msg: EngineCoreOutputs) -> list[str]:
        """On the client's thread: a step's deltas -> outputs on each caller's queue."""
        if msg.dead is not None:
            self._end(EngineDeadError(msg.dead))
            return []
        if msg.stats is not None:
            self._stats = msg.stats
        if self.output_processor is None:  # still starting: no request yet
            return []
        with self._lock:
            outs, aborts = self.output_processor.process(msg.outputs, msg.stats)
            self._deliver_many([
                (out.request_id, out if out.error is None
                 else RequestFailedError(f"generation failed: {out.error}"))
                for out in outs])
        return aborts

    def _on_core_death(self, why: str) -> None:
        """The core died unplanned (its watcher, or a request that found it gone first)."""
        if self._dead is not None:  # already reported
            return
        logger.error("%s", why)
        self._end(EngineDeadError(f"the engine stopped: {why}; see the server log"))

    def _end(self, error: EngineDeadError) -> None:
        """No more requests: answer everyone who is waiting, and whoever comes later."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
            self._deliver_many([(rid, error) for rid in self._streams])
        if not isinstance(error, EngineShutdownError):
            for callback in self._on_dead:
                try:
                    callback()
                except Exception:
                    logger.exception("an engine-death callback failed")
