"""How a front end drives an engine core that runs on its own: the core's loop, and the two
places it can run.

- `InprocClient`: the loop on a thread of this process (tests reach into the core).
- `MPClient`: the loop in a process of its own, the server's choice: detokenizing, stop
  strings, SSE framing and HTTP then never take the GIL from the step loop. Commands go
  to it and step outputs come back as msgpack over ZeroMQ sockets (ipc://), each a few
  hundred bytes per sequence and step.

Either way the front end hands its commands (add, abort, shutdown) to `send`, and the core's
messages (`EngineCoreOutputs`) reach its handler on a thread of the client's, never on an
event loop, so several event loops may share one engine. The handler returns the sequences
to abort (stop strings), which go back to the core at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore, StepError
from pagedllm.engine.messages import (
    AbortRequests,
    CoreCommand,
    CoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    Shutdown,
)
from pagedllm.heap import freeze_startup_heap
from pagedllm.log_format import configure_logging

logger = logging.getLogger(__name__)

OutputHandler = Callable[[EngineCoreOutputs], list[str]]
IDLE_POLL_S = 0.5  # an idle core wakes this often (to report its numbers)
START_TIMEOUT_S = 1800.0  # a large checkpoint from a slow disk, plus graph capture


class CoreDeadError(RuntimeError):
    """The core cannot go on; its message is what clients are told (no internals)."""


def run_core_loop(core: EngineCore, next_commands: Callable[[float | None], list],
                  emit: Callable[[EngineCoreOutputs], None], max_step_failures: int,
                  should_stop: Callable[[], bool] = lambda: False) -> bool:
    """Take commands, step while there is work, emit each step's outputs with the pool's
    numbers. Returns True when told to shut down, False when `should_stop` ended it.

    A step that raises fails its sequences (an error output each) and the loop goes on;
    after `max_step_failures` failed steps in a row, or any other failure, the core is dead:
    a last message says so and CoreDeadError is raised."""
    failures = 0
    try:
        while not should_stop():
            idle = not core.has_unfinished_requests()
            outputs: list[EngineCoreOutput] = []
            for cmd in next_commands(IDLE_POLL_S if idle else None):
                if isinstance(cmd, Shutdown):
                    return True
                if isinstance(cmd, AbortRequests):
                    core.abort_requests(cmd.request_ids)
                    continue
                try:
                    core.add_request(cmd.request)
                except ValueError as e:  # the front end checks first: this is a last guard
                    outputs.append(EngineCoreOutput(cmd.request.request_id, finish_reason="error",
                                                    error=str(e)))
            if core.has_unfinished_requests():
                try:
                    outputs += core.step()
                    failures = 0
                except StepError as e:
                    failures += 1
                    cause = e.__cause__ or e
                    logger.error("engine step failed (%d in a row); failing its %d sequences",
                                 failures, len(e.request_ids), exc_info=cause)
                    if failures >= max_step_failures:
                        raise CoreDeadError(f"{failures} engine steps failed in a row") from cause
                    core.abort_requests(e.request_ids)
                    why = (f"the engine step running this request raised {type(cause).__name__}; "
                           "see the server log")
                    outputs += [EngineCoreOutput(sid, finish_reason="error", error=why)
                                for sid in e.request_ids]
            emit(EngineCoreOutputs(outputs, core.stats()))
        return False
    except BaseException as e:  # the loop cannot continue: say so, loudly
        root = e.__cause__ if isinstance(e, CoreDeadError) and e.__cause__ else e
        logger.exception("engine core loop failed")
        message = (f"the engine stopped after an internal error ({type(root).__name__}); "
                   "see the server log")
        with contextlib.suppress(Exception):
            emit(EngineCoreOutputs(dead=message))
        raise CoreDeadError(message) from e


class InprocClient:
    """The core's loop on a daemon thread of this process."""

    def __init__(self, config: EngineConfig, handler: OutputHandler, max_step_failures: int):
        self.core = EngineCore(config)
        self.config = self.core.config
        self.info: CoreInfo = self.core.info()
        self._handler = handler
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(max_step_failures,),
                                        name="pagedllm-engine", daemon=True)
        self._thread.start()

    def _next(self, timeout: float | None) -> list:
        cmds = []
        try:
            cmds.append(self._commands.get(block=timeout is not None, timeout=timeout))
            while True:
                cmds.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _emit(self, msg: EngineCoreOutputs) -> None:
        aborts = self._handler(msg)
        if aborts:  # on the core's own thread: at once, before the next step is scheduled
            self.core.abort_requests(aborts)

    def _run(self, max_step_failures: int) -> None:
        with contextlib.suppress(CoreDeadError):
            run_core_loop(self.core, self._next, self._emit, max_step_failures, self._stop.is_set)

    def send(self, cmd: CoreCommand) -> None:
        self._commands.put(cmd)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def exit_reason(self) -> str:
        return "the engine thread stopped"

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(Shutdown())

    def shutdown(self) -> None:
        self.stop()
        self._thread.join(timeout=10)
        self.core.shutdown()


# ---------------------------------------------------------------------- a process of its own
def _exit_with_parent(parent_pid: int) -> None:
    """A core whose front end vanished (killed with SIGKILL: no atexit ran) exits on its own
    within a second instead of holding a GPU forever."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def core_process_main(config: EngineConfig, in_addr: str, out_addr: str, parent_pid: int,
                      max_step_failures: int, log_level: int) -> None:
    """The core process: build the core, report its info (or why it could not start), then
    run the loop until told to stop. Exits 0 after a shutdown, 1 when the core died."""
    import zmq

    # Signals are the front end's to handle: Ctrl-C in a terminal reaches the whole
    # process group, and the server drains before it stops the core.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level)  # the server's format: one kind of line in its log
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(in_addr)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 5000)  # the last words reach the front end before exit
    results.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        core = EngineCore(config)
    except BaseException as e:
        logger.debug("engine core failed to start", exc_info=True)
        results.send_multipart([b"error", f"{type(e).__name__}: {e}".encode()])
        results.close()
        commands.close(linger=0)  # ctx.term() waits for every socket: an open one hangs the exit
        ctx.term()
        sys.exit(1)
    freeze_startup_heap("engine core")  # pagedllm/heap.py: why
    results.send_multipart([b"ready", encoder.encode(core.info())])
    decoder = msgspec.msgpack.Decoder(CoreCommand)
    poller = zmq.Poller()
    poller.register(commands, zmq.POLLIN)

    def next_commands(timeout: float | None) -> list:
        cmds = []
        wait_ms = 0 if timeout is None else int(timeout * 1000)
        while poller.poll(wait_ms):
            cmds.append(decoder.decode(commands.recv()))
            wait_ms = 0
        return cmds

    def emit(msg: EngineCoreOutputs) -> None:
        results.send_multipart([b"out", encoder.encode(msg)], copy=False)

    code = 1
    try:
        code = 0 if run_core_loop(core, next_commands, emit, max_step_failures) else 1
    except CoreDeadError:
        pass
    finally:
        core.shutdown()
        results.close()
        commands.close(linger=0)
        ctx.term()
    sys.exit(code)


def _stop_process(proc, commands, tmpdir: str, grace_s: float = 10.0) -> None:
    """Ask the core to stop, then terminate, then kill: no core outlives its front end."""
    with contextlib.suppress(Exception):
        commands.send(msgspec.msgpack.encode(Shutdown()), flags=1)  # zmq.NOBLOCK: no core, no wait
    proc.join(timeout=grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
    shutil.rmtree(tmpdir, ignore_errors=True)


class MPClient:
    """The core's loop in a spawned process, over two ZeroMQ sockets.

    A thread here reads the core's messages and runs the handler; another watches the
    process, so a core that dies (killed, out of memory, a segfault) is seen at once:
    `on_death` is called with the exit code and the front end fails everyone."""

    def __init__(self, config: EngineConfig, handler: OutputHandler, max_step_failures: int,
                 on_death: Callable[[str], None]):
        """Returns once the process is started; `wait_ready` waits for the model to load
        (the front end reads its own config meanwhile)."""
        import multiprocessing as mp

        import zmq

        self.core = None  # not reachable from here
        self._handler, self._on_death = handler, on_death
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm-core-")
        in_addr = f"ipc://{os.path.join(self._tmpdir, 'commands')}"
        out_addr = f"ipc://{os.path.join(self._tmpdir, 'outputs')}"
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        # No high-water mark: a burst of requests queues in full while the core steps.
        # Sends never block then, except with no core to take them: those fail at once.
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.bind(in_addr)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.bind(out_addr)
        self._send_lock = threading.Lock()  # the event loop and the reader thread both send
        self._stopping = False
        self._closed = False  # tells the reader thread to close its socket and end
        # Not daemonic: a core under tensor parallelism starts worker processes itself.
        self.proc = mp.get_context("spawn").Process(
            target=core_process_main, name="pagedllm-core",
            args=(config, in_addr, out_addr, os.getpid(), max_step_failures,
                  logging.getLogger().getEffectiveLevel()))
        self.proc.start()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self._commands, self._tmpdir)
        self._encoder = msgspec.msgpack.Encoder()
        self._reader: threading.Thread | None = None
        self.info: CoreInfo | None = None

    def wait_ready(self) -> CoreInfo:
        """Until the core has loaded the model and sent its CoreInfo; then its outputs are
        read and its process watched. Raises if it failed to start (and stops it)."""
        if self.info is not None:
            return self.info
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stopping = True
            self._finalizer()
            raise
        self._reader = threading.Thread(target=self._read, name="pagedllm-core-outputs", daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, name="pagedllm-core-watch", daemon=True).start()
        return self.info

    def _wait_ready(self) -> CoreInfo:
        import zmq

        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._outputs.poll(500, zmq.POLLIN):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited with code "
                                   f"{self.proc.exitcode} while starting; see the log above")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f} s")
        kind, payload = self._outputs.recv_multipart()
        if kind == b"error":
            raise RuntimeError(payload.decode())
        return msgspec.msgpack.decode(payload, type=CoreInfo)

    def _read(self) -> None:
        """The reader owns the outputs socket (ZeroMQ sockets are not thread-safe): it
        polls briefly so that it sees `_closed`, and closes the socket itself."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        sock = self._outputs
        try:
            while not self._closed:
                if not sock.poll(100):
                    continue
                _, payload = sock.recv_multipart(copy=False)
                try:
                    aborts = self._handler(decoder.decode(payload.buffer))
                except Exception:
                    logger.exception("processing the engine core's outputs failed")
                    continue
                if aborts:
                    self.send(AbortRequests(aborts))
        finally:
            sock.close(linger=0)

    def _watch(self) -> None:
        wait([self.proc.sentinel])
        if not self._stopping:
            self._on_death(self.exit_reason())

    def exit_reason(self) -> str:
        """Why the core is gone, for clients and the log: its exit code. A request can find
        the core gone (its send fails) a moment before the process is reaped, so this
        waits up to a second for the code."""
        if self.proc.exitcode is None:
            self.proc.join(timeout=1)
        return f"the engine core process exited (exit code {self.proc.exitcode})"

    def send(self, cmd: CoreCommand) -> None:
        import zmq

        data = self._encoder.encode(cmd)
        with self._send_lock:
            try:
                self._commands.send(data, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # the core is gone (its death is reported apart)
                raise RuntimeError("the engine core is not running") from e

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self) -> None:
        """Ask the core to stop after its current step, without waiting."""
        self._stopping = True
        with contextlib.suppress(Exception):
            self.send(Shutdown())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._stopping = True
        self._finalizer()
        self._closed = True
        if self._reader is not None:
            self._reader.join(timeout=5)
        else:  # never ready: no reader owns the outputs socket
            self._outputs.close(linger=0)
        with self._send_lock:
            self._commands.close(linger=0)
        self._ctx.term()
