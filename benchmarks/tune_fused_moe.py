"""Tune the fused MoE kernels' tile sizes for one layer shape over token counts, and report
each count's time against the card's bandwidth bound for the expert weights it reads.

    python benchmarks/tune_fused_moe.py [--experts 128 --hidden 2048 --inter 768 --top-k 8]
        [--tokens 1 8 64 256 1024 4096] [--write pagedllm/model_executor/layers/configs/fused_moe.json]
        [--gpt-oss]  # gpt-oss's experts: packed MXFP4, biases, clamped SwiGLU (its own key)

Writes (merges) the best configuration per token count under the shape's key; the engine
picks the entry nearest a step's token count (fused_moe.pick_config).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from pagedllm.model_executor.layers import fused_moe


def _time(fn, iters: int = 20) -> float:
    """Median seconds of one call, replayed from a CUDA graph (what decode steps do)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def candidates(tokens: int, top_k: int, experts: int):
    per_expert = tokens * top_k / experts
    if per_expert <= 4:
        grid = itertools.product([16], [32, 64, 128], [64, 128, 256], [4], [3, 4])
    elif per_expert <= 64:
        grid = itertools.product([16, 32, 64], [64, 128], [64, 128], [4], [3])
    else:
        grid = itertools.product([64, 128], [64, 128], [64], [4, 8], [3, 4])
    for bm, bn, bk, warps, stages in grid:
        yield {"BM": bm, "BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096])
    ap.add_argument("--bandwidth", type=float, default=None, help="TB/s (default: measured copy)")
    ap.add_argument("--gpt-oss", action="store_true",
                    help="MXFP4 experts with biases and the clamped SwiGLU (e.g. --experts 32 "
                         "--hidden 2880 --inter 2880 --top-k 4 for gpt-oss-20b)")
    ap.add_argument("--write")
    ap.add_argument("--report")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    w13 = torch.randn(e, 2 * i, h, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    extra: dict = {}
    weight_bytes = 2.0
    if args.gpt_oss:  # packed bytes and exponents instead of bf16
        w13 = torch.randint(0, 256, (e, 2 * i, h // 2), device=dev, generator=g, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (e, h, i // 2), device=dev, generator=g, dtype=torch.uint8)
        extra = dict(w13_scale=torch.full((e, 2 * i, h // 32), 121, dtype=torch.uint8, device=dev),
                     w2_scale=torch.full((e, h, i // 32), 121, dtype=torch.uint8, device=dev),
                     b13=torch.zeros(e, 2 * i, device=dev, dtype=torch.bfloat16),
                     b2=torch.zeros(e, h, device=dev, dtype=torch.bfloat16), swiglu=(1.702, 7.0))
        weight_bytes = 0.5 + 1 / 32
    if args.bandwidth is None:
        buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        sec = _time(lambda: buf[: 1 << 29].copy_(buf[1 << 29:]), iters=10)
        args.bandwidth = 2 * (1 << 29) / sec / 1e12
    name = torch.cuda.get_device_name(dev)
    print(f"{name}: copy bandwidth {args.bandwidth:.2f} TB/s; E={e} H={h} I={i} k={k}")
    best_table, report = {}, []
    for t in args.tokens:
        x = torch.randn(t, h, device=dev, generator=g, dtype=torch.bfloat16)
        weights, ids = torch.topk(torch.randn(t, e, device=dev, generator=g).softmax(-1), k)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * 3 * h * i * weight_bytes + t * h * 2 * 2
        default = fused_moe.pick_config(t * k, e, h, i, k, args.gpt_oss)
        results = []
        for cfg in [default, *candidates(t, k, e)]:
            try:
                sec = _time(lambda cfg=cfg, x=x, w=weights, ids=ids:
                            fused_moe.fused_experts(x, w13, w2, w, ids, cfg, **extra))
            except Exception as exc:  # a configuration that does not fit the card's shared memory
                print(f"  skip {cfg}: {type(exc).__name__}")
                continue
            results.append((sec, cfg))
        sec, cfg = min(results, key=lambda r: r[0])
        dsec = next(s for s, c in results if c is default)
        bound = nbytes / (args.bandwidth * 1e12)
        row = {"tokens": t, "distinct_experts": distinct, "best_us": round(sec * 1e6, 1),
               "default_us": round(dsec * 1e6, 1), "bound_us": round(bound * 1e6, 1),
               "fraction_of_bound": round(bound / sec, 3), "config": cfg}
        report.append(row)
        best_table[str(t)] = cfg
        print(json.dumps(row))
    if args.write:
        table = {}
        if os.path.exists(args.write):
            with open(args.write) as f:
                table = json.load(f)
        table[fused_moe.shape_key(e, h, i, k, args.gpt_oss)] = {"_card": name, **best_table}
        with open(args.write, "w") as f:
            json.dump(table, f, indent=1)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"card": name, "bandwidth_TBps": args.bandwidth, "shape": [e, h, i, k],
                       "rows": report}, f, indent=1)


if __name__ == "__main__":
    main()
