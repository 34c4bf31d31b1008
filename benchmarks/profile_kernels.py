"""Where one run of a workload spends its time, kernel by kernel: the run under
torch.profiler, the kernels grouped by name with their total device time, and the
wall-clock time beside the summed device time (the difference is the host's share, or
device idle time). For the gaps the benchmarks leave unexplained: a 32k prompt's time to
first token against HF (gpu-long-ttft), an embedding batch against sentence-transformers.

    python benchmarks/profile_kernels.py --workload gpu-long-ttft [--top 25] [--json F]
    python benchmarks/profile_kernels.py --embed [--num-inputs 2048 --input-len 256]
    python benchmarks/profile_kernels.py --workload gpu-7b --lora 16   (where one adapter's time goes)
    python benchmarks/profile_kernels.py --workload trt-8b-2k --num-prompts 512 --output-len 256 --max-num-seqs 512

The first form runs a BENCHMARKS.md workload (dummy weights, its prompts); the second,
embed_bench.py's Qwen3-0.6B-shape pooling checkpoint. One warm-up run, then one profiled.
On the CPU it runs too (CPU operators only), which is how the script itself is checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import WORKLOADS, random_dataset, write_arch_config


def _generate_run(args):
    w = WORKLOADS[args.workload]
    config = dict(w.arch_config)
    if args.num_hidden_layers:
        config["num_hidden_layers"] = args.num_hidden_layers
    lora_kw, adapter = {}, None
    if args.lora:  # one random PEFT adapter of that rank on every linear layer, for every prompt
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from lora_bench import write_adapters

        from pagedllm import LoRARequest

        path = write_adapters(tempfile.mkdtemp(prefix="pagedllm-profile-lora-"), config, 1, args.lora)[0]
        adapter = LoRARequest("adapter0", 1, path)
        lora_kw = dict(enable_lora=True, max_loras=1, max_lora_rank=args.lora)
    engine_kw = dict(lora_kw, **w.engine_kwargs(args.max_num_seqs))  # the workload's FP8 weights / pages, batch cap
    llm = LLM(model=write_arch_config(config), load_format="dummy", dtype=w.dtype,
              skip_tokenizer_init=True, device=args.device,
              enable_prefix_caching=False, **engine_kw)  # the profiled run must recompute the prompt
    vocab = llm.engine.executor.vocab_size
    num = args.num_prompts or w.num_prompts
    lo, hi = w.input_range
    if args.input_len:
        lo = hi = args.input_len
    out = (args.output_len, args.output_len) if args.output_len else w.output_range
    data = random_dataset(num, (lo, hi), out, vocab, 0)
    prompts = [{"prompt_token_ids": p} for p in data.prompts]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0) for n in data.output_lens]
    return lambda: llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)


def _embed_run(args):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import embed_bench

    directory = tempfile.mkdtemp(prefix="pagedllm-embed-")
    embed_bench.build_checkpoint(directory, 0, args.num_hidden_layers)
    texts = embed_bench.make_texts(args.num_inputs, args.input_len or 256,
                                   embed_bench.QWEN3_0_6B_CONFIG["vocab_size"], 0)
    llm = LLM(model=directory, runner="pooling", device=args.device, max_model_len=4096,
              dtype="bfloat16" if args.device == "cuda" else "float32",
              max_num_batched_tokens=16384)
    return lambda: llm.embed(texts)


def kernel_totals(prof, cuda: bool) -> dict[str, list[float]]:
    """A profile's device kernels by name when there is a device, else its CPU operators,
    both by self time: name -> [microseconds, calls]."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or (cuda and e.device_type.name != "CUDA"):
            continue
        totals[e.key][0] += us
        totals[e.key][1] += e.count
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="gpu-long-ttft")
    ap.add_argument("--embed", action="store_true", help="profile embed_bench.py's pooling run instead")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--num-inputs", type=int, default=2048)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the engine's cap on running sequences")
    ap.add_argument("--num-hidden-layers", type=int, default=None, help="fewer layers (smoke runs)")
    ap.add_argument("--lora", type=int, default=None, metavar="RANK",
                    help="every prompt through one random adapter of this rank (Llama-shaped workloads)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    run = _embed_run(args) if args.embed else _generate_run(args)
    cuda = args.device == "cuda"
    run()  # warm-up: kernels compiled, graphs captured, allocator primed
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    totals = kernel_totals(prof, cuda)
    busy = sum(t for t, _ in totals.values()) / 1e6
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]
    what = "device" if cuda else "CPU operator"
    print(f"{'embed' if args.embed else args.workload} on {torch.cuda.get_device_name() if cuda else 'CPU'}: "
          f"wall {wall:.3f} s, {what} time {busy:.3f} s ({100 * busy / wall:.0f}% of wall)")
    for name, (us, count) in rows:
        print(f"{us / 1e3:10.2f} ms {100 * us / 1e6 / busy:5.1f}%  x{count:<6d} {name[:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "embed" if args.embed else args.workload, "args": vars(args), "wall_s": wall,
                       "busy_s": busy, "by": what,
                       "top": [{"name": n, "ms": us / 1e3, "count": c} for n, (us, c) in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
