"""What one steady step of a large batch costs on the device, kernel by kernel, at the
context length a workload's decodes actually run at (profile_kernels.py profiles a whole
run, whose short early contexts hide what attention costs late in it).

    python benchmarks/decode_step_profile.py --workload trt-8b-2k --num-prompts 512 --input-len 1024
        [--decode-steps 24] [--profile-steps 6] [--json F]

Steps run as LLM.generate runs them (engine.step(final_only=True): no per-step output for
a request that has not finished). Every prompt is queued at once; the prefill steps are timed (wall, scheduling to
scheduling) and the steps from the third to the fifth are profiled; once every sequence
decodes, `--decode-steps` steps are timed without the profiler (the step's wall time, CUDA
graphs as the engine runs them) and `--profile-steps` more under torch.profiler. The
kernels are grouped (attention, FP8 products, bf16 products, quantisation, norms, ...),
per step, beside the wall time: their difference is time the device sat idle or ran
nothing the profiler saw. The workload's FP8 weights and pages (trt-8b-*) are used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import WORKLOADS, write_arch_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_kernels import kernel_totals  # noqa: E402

# (group, substrings of a kernel's name), first match wins
GROUPS = [
    ("attention", ("_paged_attention_kernel", "_combine_splits", "_decode_rows", "flashinfer", "BatchDecode",
                   "BatchPrefill")),
    ("kv write", ("_write_kv",)),
    ("fp8 quantize", ("quant",)),
    ("rms norm", ("rms",)),
    ("silu*mul", ("silu",)),
    ("rotary", ("rotary", "rope")),
    ("sampling", ("sampl", "gumbel", "argmax", "topk", "softmax", "_draw", "exponential")),
    ("fp8 product", ("e4m3", "f8f8", "fp8", "f8_")),
    ("bf16 product", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")),
    ("embedding", ("embedding", "index_select", "gather")),
    ("copy / elementwise", ("elementwise", "copy", "fill", "memcpy", "memset", "cat")),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def summarise(totals: dict[str, list[float]], steps: int, wall_ms: float, top: int) -> dict:
    """Per-step milliseconds by group and the top kernels, printed and returned."""
    groups: dict[str, float] = defaultdict(float)
    for name, (us, _) in totals.items():
        groups[group_of(name)] += us / 1e3 / steps
    busy = sum(groups.values())
    print(f"  wall {wall_ms:.2f} ms/step, kernels {busy:.2f} ms/step, rest {wall_ms - busy:.2f}")
    for g, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"    {g:20s} {ms:8.3f} ms  {100 * ms / max(wall_ms, 1e-9):5.1f}%")
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    for name, (us, count) in rows:
        print(f"      {us / 1e3 / steps:8.3f} ms x{count / steps:6.1f}  {name[:100]}")
    return {"wall_ms": wall_ms, "kernels_ms": busy, "groups_ms": dict(groups),
            "top": [{"name": n, "ms_per_step": us / 1e3 / steps, "launches_per_step": c / steps}
                    for n, (us, c) in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="trt-8b-2k", choices=sorted(WORKLOADS))
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=6, help="0: no profile, the timing only")
    ap.add_argument("--num-hidden-layers", type=int, default=None, help="fewer layers (smoke runs)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    config = dict(w.arch_config)
    if args.num_hidden_layers:
        config["num_hidden_layers"] = args.num_hidden_layers
    llm = LLM(model=write_arch_config(config), load_format="dummy", dtype=w.dtype, skip_tokenizer_init=True,
              device=args.device, enable_prefix_caching=False,
              **w.engine_kwargs(args.max_num_seqs or args.num_prompts))
    engine = llm.engine
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    steps: list[tuple[float, int, int]] = []  # (scheduled at, sequences, tokens)
    schedule = engine.scheduler.schedule

    def traced():
        out = schedule()
        steps.append((time.perf_counter(), len(out.chunks), out.num_batched_tokens))
        return out

    engine.scheduler.schedule = traced
    g = torch.Generator().manual_seed(0)
    vocab = min(30000, config["vocab_size"])
    params = SamplingParams(temperature=1.0, max_tokens=100_000, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    for i in range(args.num_prompts):
        ids = torch.randint(0, vocab, (args.input_len,), generator=g).tolist()
        engine.add_request(f"p{i}", None, ids, params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps.clear()
    prefill_prof = None
    n = 0
    sync()
    while not steps or steps[-1][2] != args.num_prompts:  # until a step is every sequence's decode
        if n == 2 and prefill_prof is None and args.profile_steps:
            sync()
            prefill_prof = profile(activities=activities)
            prefill_prof.__enter__()
            t_prof = time.perf_counter()
            n_prof = len(steps)
        engine.step(final_only=True)
        n += 1
        if prefill_prof is not None and n == 5:
            sync()
            prefill_wall = (time.perf_counter() - t_prof) * 1e3 / (len(steps) - n_prof)
            prefill_prof.__exit__(None, None, None)
            prefill_prof_steps = len(steps) - n_prof
    if prefill_prof is not None and n < 5:
        prefill_prof.__exit__(None, None, None)
        prefill_prof = None
    pre = [(b[0] - a[0], a[2]) for a, b in zip(steps, steps[1:], strict=False) if a[2] != a[1]]
    pre_s, pre_tokens = sum(t for t, _ in pre), sum(n for _, n in pre)
    result: dict = {"benchmark": "decode_step_profile", "workload": args.workload,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "num_prompts": args.num_prompts,
                    "input_len": args.input_len, "prefill": {"steps": len(pre), "s": pre_s, "tokens": pre_tokens}}
    print(f"{args.workload}: {args.num_prompts} prompts of {args.input_len} tokens on {result['device']}")
    print(f"prefill: {len(pre)} steps, {pre_s:.2f} s, {pre_tokens / max(pre_s, 1e-9):,.0f} prompt tok/s")
    if prefill_prof is not None:
        print(f"prefill steps 3-5 under the profiler ({prefill_prof_steps} steps):")
        result["prefill"]["profile"] = summarise(kernel_totals(prefill_prof, cuda), prefill_prof_steps, prefill_wall, args.top)
    for _ in range(4):  # every sequence decoding, graphs warm
        engine.step(final_only=True)
    sync()
    first = len(steps)
    graphs = getattr(getattr(engine.executor, "runner", None), "graphs", None)
    replays0 = graphs.replays if graphs is not None else 0
    if graphs is not None and cuda:
        graphs.timing = []  # the device's time inside each replay, apart from the host's
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        engine.step(final_only=True)
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / args.decode_steps
    device_ms = None
    if graphs is not None and graphs.timing:
        device_ms = sum(a.elapsed_time(b) for a, b in graphs.timing) / len(graphs.timing)
        graphs.timing = None
    # how many of the timed steps replayed a CUDA graph (the rest ran eagerly: a step that
    # did not fit a captured graph, or graphs off), so a slow figure says why
    replayed = graphs.replays - replays0 if graphs is not None else 0
    ctx = args.input_len + (first + args.decode_steps // 2 - len(pre))  # about, mid-way
    print(f"decode: {steps[first][1]} sequences at about {ctx} keys: {wall:.2f} ms/step "
          f"({steps[first][1] / wall * 1e3:,.0f} output tok/s), {replayed} of {args.decode_steps} steps "
          f"replayed CUDA graphs")
    if device_ms is not None:  # the device's time in the replays against the wall: the rest is the host's
        print(f"  the device ran {device_ms:.2f} ms of each replayed step ({wall - device_ms:.2f} ms/step "
              f"without device work: the host's share)")
    result["decode"] = {"sequences": steps[first][1], "context": ctx, "wall_ms": wall,
                        "graph_replays": replayed, "steps": args.decode_steps, "device_ms": device_ms}
    if args.profile_steps:
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                engine.step(final_only=True)
            sync()
            pwall = (time.perf_counter() - t0) * 1e3 / args.profile_steps
        print(f"decode steps under the profiler ({args.profile_steps}):")
        result["decode"]["profile"] = summarise(kernel_totals(prof, cuda), args.profile_steps, pwall, args.top)
    for i in range(args.num_prompts):
        engine.abort_request(f"p{i}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
