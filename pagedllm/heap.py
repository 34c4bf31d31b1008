"""The Python heap of an engine process, frozen once it has started.

Python's full (generation-2) garbage collection walks every container object the process
holds. Once an engine has started that is hundreds of thousands of them (torch, triton,
transformers, the model's modules, the tokenizer), almost all alive until the process
ends. A step, meanwhile, makes thousands of objects (its chunks, its outputs) of which some
live through a step or two, long enough to reach the oldest generation: that alone
triggers a full collection every hundred steps or so, and each one stops the host for
about 0.2 s. Under async scheduling the host queues step N+1 while the device runs step N
and has some 13 ms of slack at 512 sequences; a pause past that leaves the device idle.
On an H100, trt-8b-2k's 512-request wave spent 4.0 s of its 56.6 s with the device idle
between steps (benchmarks/results/2026-12-08-gpu-h100-host-gaps-trt-8b-2k-*.json), about
what the same wave's 21 full collections take on this project's CPU (4.2 s).

`gc.freeze()` moves every object alive at that point out of the collector's sight. Full
collections still come, more often, but walk only what the run itself made: on the CPU the
wave's shape spent 1.1 s in 44 of them instead of 4.2 s in 21
(benchmarks/results/2026-12-08-cpu-gc-pauses-*.json), most of it in the sequences' token
lists, item by item; the engine now keeps those ids in arrays whose items the collector
never visits (pagedllm/core/token_array.py), and a pass costs about 5 ms
(benchmarks/results/2026-12-08-cpu-gc-token-arrays-*.json). An
object frozen is never collected, so the heap is frozen once startup's garbage has been
collected, and only in the processes that run for the engine's lifetime.
PAGEDLLM_GC_FREEZE=0 leaves the heap alone (the test suite builds hundreds of engines in
one process, where frozen cycles would only pile up). An engine's shutdown thaws the heap
(`thaw_heap`), and so does the start of another engine in the same process, so that a
dropped engine's memory is freed as before; and so does the interpreter's exit, whose last
collection must free what was frozen (native extensions report objects left alive then as
leaks).
"""

from __future__ import annotations

import atexit
import gc
import logging

from pagedllm.config import env_flag

logger = logging.getLogger(__name__)
_thaw_at_exit = False  # gc.unfreeze registered with atexit


def freezing() -> bool:
    """Whether engine processes freeze their startup heap (PAGEDLLM_GC_FREEZE, on unless 0)."""
    return env_flag("PAGEDLLM_GC_FREEZE", default=True)


def thaw_heap() -> None:
    """Give frozen objects back to the collector and collect: when an engine shuts down,
    and before one starts in a process where an earlier engine froze the heap. A dropped
    engine's objects that sit in reference cycles are garbage only a collection frees, and
    frozen they never would be: its KV pool would hold the device's memory that the next
    engine (or a benchmark's baseline, after `del`) sizes its own by."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def freeze_startup_heap(where: str) -> int:
    """Collect startup's garbage, then freeze what is left; returns the objects now frozen
    (0 when PAGEDLLM_GC_FREEZE=0). Called again later in the same process (a front end
    that built its tokenizer after the core started), it freezes the objects made since."""
    if not freezing():
        return 0
    gc.collect()
    gc.freeze()
    global _thaw_at_exit
    if not _thaw_at_exit:
        atexit.register(gc.unfreeze)
        _thaw_at_exit = True
    count = gc.get_freeze_count()
    logger.debug("%s: %d objects frozen out of the garbage collector's full passes", where, count)
    return count
