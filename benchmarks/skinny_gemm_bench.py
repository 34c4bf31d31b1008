"""Dense products of a decode step at 1..8 rows (CUDA): cuBLAS (F.linear) against the
few-row kernel (pagedllm/model_executor/layers/skinny_gemm.py) at its default launch and
at other tile settings.

Each product is timed inside a CUDA graph that runs it over enough distinct weights to
exceed the L2 cache (a step reads each layer's weight from memory once), replayed 20
times; the figure is microseconds a product and the weight bytes over that time. Every
setting is checked against a float32 product first.

    python benchmarks/skinny_gemm_bench.py [--rows 1 2 4 8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from pagedllm.model_executor.layers import skinny_gemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import cuda_time  # noqa: E402

# name -> (N, K): the out and in features of one layer's product
SHAPES = {
    "moe-qkv": (5120, 2048), "moe-o": (2048, 4096), "moe-router": (128, 2048),
    "moe-lm-head": (151936, 2048),
    "7b-qkv": (12288, 4096), "7b-o": (4096, 4096), "7b-gate-up": (22016, 4096), "7b-down": (4096, 11008),
}
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
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    results = []
    for name in args.shapes:
        n, k = SHAPES[name]
        size = n * k * 2
        copies = max(8, min(64, -(-400_000_000 // size)))  # past the L2, under a few GB
        ws = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = (x.float() @ ws[0].float().T)
            row = {"shape": name, "n": n, "k": k, "rows": m}
            row["cublas_us"] = per_call_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]), copies)
            default = skinny_gemm.launch_config(m, n, k)
            configs = {default}
            mb = default[0]
            for bn in SWEEP_BN:
                for bk in SWEEP_BK:
                    if mb * bn * bk <= 16384:
                        configs.add((mb, bn, bk, 4 if mb * bn * bk <= 4096 else 8))
            timed = []
            for cfg in sorted(configs):
                err = (skinny_gemm.skinny_linear(x, ws[0], config=cfg).float() - ref).abs().max().item()
                if err > 5e-2:
                    raise SystemExit(f"{name} rows {m} config {cfg}: max error {err}")
                timed.append((per_call_us(
                    lambda i, c=cfg, x=x, ws=ws: skinny_gemm.skinny_linear(x, ws[i], config=c), copies),
                              cfg))
            row["default"] = list(default)
            row["default_us"] = next(t for t, c in timed if c == default)
            best_t, best_c = min(timed)
            row["best_us"], row["best"] = best_t, list(best_c)
            for key in ("cublas_us", "default_us", "best_us"):
                row[key.replace("_us", "_TBps")] = round(size / row[key] / 1e6, 2)
                row[key] = round(row[key], 2)
            results.append(row)
            print(f"{name:12s} rows {m}: cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_TBps']:.2f} TB/s)  "
                  f"skinny {row['default_us']:7.2f} us {tuple(default)}  best {row['best_us']:7.2f} us "
                  f"{tuple(best_c)} ({row['best_TBps']:.2f} TB/s)", flush=True)
        ws.clear()  # free this shape's weights before the next
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "dense products of a decode step at few rows: cuBLAS vs skinny_gemm",
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
