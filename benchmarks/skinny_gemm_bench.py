"""Dense products of a decode step at 1..8 rows (CUDA): cuBLAS (F.linear) against the
few-row kernel (pagedllm/model_executor/layers/skinny_gemm.py) at its default launch and
at other tile settings. With --fp8 the weights are e4m3 with one scale a row (the 8B
shapes by default) and the kernel (weight-only: the row as it is, the weight widened as it
is read) is timed against the engine's other FP8 product, the row quantized per token and
torch._scaled_mm (`scaled_mm_us`), beside bf16 F.linear on the same weights (`cublas_us`).

Each product is timed inside a CUDA graph that runs it over enough distinct weights to
exceed the L2 cache (a step reads each layer's weight from memory once), replayed 20
times; the figure is microseconds a product and the weight bytes over that time. Every
setting is checked against a float32 product first.

    python benchmarks/skinny_gemm_bench.py [--rows 1 2 4 8] [--fp8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers import skinny_gemm
from pagedllm.model_executor.layers.quantization import fp8

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import cuda_time  # noqa: E402

# name -> (N, K): the out and in features of one layer's product
SHAPES = {
    "moe-qkv": (5120, 2048), "moe-o": (2048, 4096), "moe-router": (128, 2048),
    "moe-lm-head": (151936, 2048),
    "7b-qkv": (12288, 4096), "7b-o": (4096, 4096), "7b-gate-up": (22016, 4096), "7b-down": (4096, 11008),
    "8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate-up": (28672, 4096), "8b-down": (4096, 14336),
}
FP8_SHAPES = ["8b-qkv", "8b-o", "8b-gate-up", "8b-down"]
SWEEP_BN = (2, 4, 8, 16)
SWEEP_BK = (256, 512, 1024)


def per_call_us(fn, copies: int) -> float:
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    return cuda_time(g.replay, 20) * 1e3 / copies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=None, help="default: all (--fp8: the 8B ones)")
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights, one scale a row")
    ap.add_argument("--no-sweep", action="store_true", help="the default launch setting alone (a short call)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    results = []
    for name in args.shapes or (FP8_SHAPES if args.fp8 else list(SHAPES)):
        n, k = SHAPES[name]
        size = n * k * (1 if args.fp8 else 2)  # the kernel's weight bytes
        copies = max(8, min(64, -(-400_000_000 // size)))  # past the L2, under a few GB
        floats = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        ops, scales = floats, [None] * copies
        if args.fp8:
            quantized = [fp8.quantize_rows(w) for w in floats]
            floats = [fp8.dequantize(q, s, k, dtype) for q, s in quantized]  # cuBLAS's bf16 twins
            ops, scales = [q for q, _ in quantized], [s.reshape(-1) for _, s in quantized]
            del quantized
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.float() @ floats[0].float().T)
            row = {"shape": name, "n": n, "k": k, "rows": m, "weights": "fp8" if args.fp8 else "bf16"}
            row["cublas_us"] = per_call_us(lambda i, x=x, fl=floats: F.linear(x, fl[i]), copies)
            bytes_of = {"cublas_us": n * k * 2, "default_us": size, "best_us": size}
            if args.fp8:
                row["scaled_mm_us"] = per_call_us(
                    lambda i, x=x, w=ops, sc=scales, kk=k: fp8.scaled_mm(x, w[i], sc[i].view(-1, 1), kk), copies)
                bytes_of["scaled_mm_us"] = size
            default = skinny_gemm.launch_config(m, n, k, fp8=args.fp8)
            configs = {default}
            mb = default[0]
            for bn in () if args.no_sweep else SWEEP_BN:
                for bk in SWEEP_BK:
                    if mb * bn * bk <= 16384:
                        configs.add((mb, bn, bk, 4 if mb * bn * bk <= 4096 else 8))
            timed = []
            for cfg in sorted(configs):
                got = skinny_gemm.skinny_linear(x, ops[0], config=cfg, scale=scales[0])
                err = (got.float() - ref).abs().max().item()
                if err > 5e-2:
                    raise SystemExit(f"{name} rows {m} config {cfg}: max error {err}")
                timed.append((per_call_us(
                    lambda i, c=cfg, x=x, w=ops, sc=scales: skinny_gemm.skinny_linear(x, w[i], config=c, scale=sc[i]),
                    copies), cfg))
            row["default"] = list(default)
            row["default_us"] = next(t for t, c in timed if c == default)
            best_t, best_c = min(timed)
            row["best_us"], row["best"] = best_t, list(best_c)
            for key, nbytes in bytes_of.items():
                row[key.replace("_us", "_TBps")] = round(nbytes / row[key] / 1e6, 2)
                row[key] = round(row[key], 2)
            results.append(row)
            fp8_part = f"scaled_mm {row['scaled_mm_us']:7.2f} us  " if args.fp8 else ""
            print(f"{name:12s} rows {m}: cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_TBps']:.2f} TB/s)  "
                  f"{fp8_part}skinny {row['default_us']:7.2f} us {tuple(default)}  best {row['best_us']:7.2f} us "
                  f"{tuple(best_c)} ({row['best_TBps']:.2f} TB/s)", flush=True)
        del floats, ops, scales  # free this shape's weights before the next
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "dense products of a decode step at few rows: cuBLAS (and torch._scaled_mm with --fp8) vs skinny_gemm",
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
