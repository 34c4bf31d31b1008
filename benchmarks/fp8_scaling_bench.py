"""FP8 products of the Llama-3.1-8B linear shapes by scaling granularity (CUDA): row-wise
(per-token activation and per-channel weight scales, what the engine runs) against one
scale per tensor (cuBLASLt's plain FP8 path) and bf16, at decode, batch and prefill rows.
Whether the row-wise scales cost speed, and where.

    python benchmarks/fp8_scaling_bench.py [--rows 64 512 8192] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import cuda_time  # noqa: E402

SHAPES = {"8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336)}


def times(x, w, x8, w8, x_scale, w_scale) -> tuple[float, float, float]:
    """Milliseconds of the bf16, the row-wise-scaled and the tensor-scaled product."""
    one = torch.ones((), device="cuda", dtype=torch.float32)
    return (cuda_time(lambda: x @ w.t(), iters=50),
            cuda_time(lambda: torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale,
                                               out_dtype=torch.bfloat16), iters=50),
            cuda_time(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16), iters=50))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 512, 8192])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fp8 = torch.float8_e4m3fn
    rows = []
    print(f"{'layer':11s} {'rows':>5s} {'bf16':>8s} {'rowwise':>8s} {'tensor':>8s}  (us; TFLOP/s of the best)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        w8 = w.to(fp8)
        w_scale_row = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8 = x.to(fp8)
            x_scale_row = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
            t_bf16, t_row, t_ten = times(x, w, x8, w8, x_scale_row, w_scale_row)
            best = min(t_row, t_ten)
            print(f"{name:11s} {m:5d} {t_bf16 * 1e3:8.1f} {t_row * 1e3:8.1f} {t_ten * 1e3:8.1f}  "
                  f"{2 * m * n * k / best / 1e9:6.0f}")
            rows.append({"layer": name, "rows": m, "out": n, "in": k, "bf16_us": round(t_bf16 * 1e3, 2),
                         "rowwise_us": round(t_row * 1e3, 2), "tensorwise_us": round(t_ten * 1e3, 2)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fp8_scaling", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
