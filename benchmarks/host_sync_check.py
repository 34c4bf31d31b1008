"""Where does a CUDA step wait for the device? Async scheduling only helps if nothing in
schedule -> launch blocks on the queued kernels, so this runs a short random-weight
workload with torch's sync debug mode on and lists every synchronising call site, then
times the same workload with async scheduling on and off.

    python benchmarks/host_sync_check.py [--workload gpu-0.6b] [--num-prompts 128]
    python benchmarks/host_sync_check.py --workload trt-8b-2k --num-prompts 512 --max-num-seqs 512 \
        --output-len 512 --only-async     (the host's share of a 512-sequence FP8 step)

A workload's own FP8 weights and pages (trt-8b-*) are used. The "result(wait)" row is the
time the host waited for the device: where it is most of a step, the device is the limit;
where it is near zero, the host is.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import warnings

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import WORKLOADS, write_arch_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gc_pauses import GCPasses, set_heap  # noqa: E402

_RESULT = None
STEPS: list[tuple[float, int, int]] = []  # (time scheduled, sequences, tokens) per step
# CUDA events around each launch (start, end, sequences): on the device's own clock, the
# time between one launch's end and the next one's start is where the stream ran dry
# (or ran work queued outside a launch: swaps, copies), which the host view cannot tell.
EVENTS: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []


# The step groups of both tables, by how many sequences a step ran: (lowest, highest, name)
GROUPS = [(1, 16, "1-16"), (17, 64, "17-64"), (65, 256, "65-256"), (257, 448, "257-448"), (449, 1 << 30, "449+")]


def by_size(steps: list[tuple[float, int, int]]) -> list[tuple[str, int, float, int]]:
    """Steps grouped by how many sequences they ran: (group, steps, seconds from each step's
    scheduling to the next one's, tokens). Under async scheduling a step's interval is
    about the device time of the step before it."""
    rows = []
    for lo, hi, name in GROUPS:
        sel = [(b[0] - a[0], a[2]) for a, b in zip(steps, steps[1:], strict=False) if lo <= a[1] <= hi]
        if sel:
            rows.append((name, len(sel), sum(t for t, _ in sel), sum(n for _, n in sel)))
    return rows


def sync() -> None:
    """Wait for the device (nothing to wait for on the CPU, where the script also runs)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_gaps(events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]]) -> list[tuple]:
    """Per group of steps (by sequences): (group, steps, device ms inside launches, device ms
    from each launch's end to the next one's start, the median gap, the longest, and the
    count and sum of gaps over 5 ms: a few long pauses of the host, or a short one every
    step). Call after a synchronize."""
    rows = []
    for lo, hi, name in GROUPS:
        busy = 0.0
        gaps = []
        for (s0, e0, seqs), (s1, _, _) in zip(events, events[1:], strict=False):
            if lo <= seqs <= hi:
                busy += s0.elapsed_time(e0)
                gaps.append(e0.elapsed_time(s1))
        if gaps:
            long = [g for g in gaps if g > 5.0]
            rows.append((name, len(gaps), busy, sum(gaps), sorted(gaps)[len(gaps) // 2], max(gaps),
                         len(long), sum(long)))
    return rows


def instrument(engine) -> dict:
    """Wall time spent in each part of the engine's step (host view)."""
    from pagedllm.worker import model_runner

    global _RESULT
    _RESULT = _RESULT or model_runner.LaunchedStep.result
    timers: dict = collections.defaultdict(lambda: [0, 0.0])

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name][0] += 1
                timers[name][1] += time.perf_counter() - t
        return wrapper

    schedule = timed("schedule", engine.scheduler.schedule)

    def traced():  # each step's start and size, for the by-size table
        out = schedule()
        STEPS.append((time.perf_counter(), len(out.chunks), out.num_batched_tokens))
        return out

    engine.scheduler.schedule = traced
    engine.scheduler.update = timed("update", engine.scheduler.update)
    runner = engine.executor.runner
    launch = timed("launch", runner.launch)

    def evented(so, *a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return launch(so, *a, **k)
        finally:
            end.record()
            EVENTS.append((start, end, len(so.chunks)))

    runner.launch = evented if torch.cuda.is_available() else launch
    runner.execute = timed("execute", runner.execute)
    runner._layout = timed("layout", runner._layout)
    runner._sampling_batch = timed("sampling_batch", runner._sampling_batch)
    if runner.graphs is not None:
        runner.graphs.run = timed("graph_run", runner.graphs.run)
    runner.model.forward = timed("model_forward", runner.model.forward)
    engine.core._process = timed("process", engine.core._process)
    engine.output_processor.process = timed("output_process", engine.output_processor.process)
    engine.step = timed("step", engine.step)
    model_runner.LaunchedStep.result = timed("result(wait)", _RESULT)
    return timers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="gpu-0.6b", choices=["gpu-0.6b", "gpu-7b", "trt-8b-1k", "trt-8b-2k"])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=None, help="GiB of pinned host pages for preempted sequences")
    p.add_argument("--only-async", action="store_true", help="skip the sync-site listing and the run without async")
    p.add_argument("--gc-modes", nargs="+", choices=["frozen", "thawed"], default=["frozen"],
                   help="the startup heap frozen (the engine's default, pagedllm/heap.py) or thawed "
                        "(gc.unfreeze()) for each timed run with async scheduling, in this order")
    args = p.parse_args()
    w = WORKLOADS[args.workload]
    path = write_arch_config(w.arch_config)
    engine_kw = w.engine_kwargs(args.max_num_seqs)
    if args.swap_space is not None:
        engine_kw["swap_space"] = args.swap_space
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, min(30000, w.arch_config["vocab_size"]), (args.input_len,), generator=g).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    llm = LLM(model=path, load_format="dummy", dtype="bfloat16", async_scheduling=True,
              skip_tokenizer_init=True, **engine_kw)
    llm.generate(prompts[:8], params)  # warm-up
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "pagedllm" in f.filename]
        sites[" <- ".join(f"{f.filename.split('pagedllm/')[-1]}:{f.lineno}" for f in stack[-3:][::-1])] += 1

    if not args.only_async:
        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        llm.generate(prompts[:32], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True))
        torch.cuda.set_sync_debug_mode(0)
        print("synchronising call sites (count):")
        for site, n in sites.most_common(20):
            print(f"  {n:6d}  {site}")
    timers = instrument(llm.engine)
    runs = [(True, m) for m in args.gc_modes]
    if not args.only_async:
        runs += [(False, args.gc_modes[0]), (True, args.gc_modes[0])]
    for asyn, mode in runs:
        frozen = set_heap(mode)
        llm.engine.core.async_scheduling = asyn
        llm.engine.step()  # reads a step left in flight
        timers.clear()
        STEPS.clear()
        EVENTS.clear()
        with GCPasses() as gcp:
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync()
            dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append((asyn, mode, frozen, n / dt, dt, {k: tuple(v) for k, v in timers.items()}, by_size(STEPS),
                     device_gaps(EVENTS), {g: tuple(v) for g, v in sorted(gcp.passes.items())}))
    for asyn, mode, frozen, tps, dt, timers, sizes, gaps, passes in rows:
        print(f"async_scheduling={asyn!s:5} heap {mode:6s} {tps:10.1f} output tok/s  {dt:.3f} s  "
              f"({frozen} objects frozen)")
        for g, (count, secs) in passes.items():
            print(f"    garbage collection, generation {g}: {count:5d} passes {secs * 1e3:9.1f} ms")
        for name, count, secs, tokens in sizes:
            print(f"    steps of {name:>8s} sequences: {count:5d} steps {secs:8.3f} s  {tokens:8d} tokens  "
                  f"{secs / count * 1e3:7.2f} ms/step")
        for name, count, busy, gap, median, longest, n_long, long_ms in gaps:
            print(f"    device, steps of {name:>8s}: {count:5d} steps, in launches {busy / 1e3:8.3f} s "
                  f"({busy / count:6.2f} ms/step), between launches {gap / 1e3:7.3f} s ({gap / count:5.2f} ms/step; "
                  f"median {median:5.2f} ms, longest {longest:6.1f} ms, {n_long} over 5 ms: {long_ms / 1e3:6.3f} s)")
        for name, (count, total) in sorted(timers.items()):
            print(f"    {name:18s} {count:6d} calls {total * 1e3:9.1f} ms  {total / max(count, 1) * 1e3:7.3f} ms/call")


if __name__ == "__main__":
    main()
