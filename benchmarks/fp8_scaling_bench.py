"""FP8 products of the Llama-3.1-8B linear shapes by scaling granularity (CUDA): row-wise
(per-token activation and per-channel weight scales, what the engine runs) against one
scale per tensor (cuBLASLt's plain FP8 path) and bf16, at decode, batch and prefill rows,
each FP8 form with float32 promotion along K and in fast-accumulation mode
(PAGEDLLM_FP8_FAST_ACCUM), with the error each mode's product has against float32.
Whether the row-wise scales or the promotion cost speed, and where.

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


def times(x, w, x8, w8, x_scale, w_scale) -> dict[str, float]:
    """Milliseconds of the bf16 product and of the row-wise- and tensor-scaled ones, each
    with float32 promotion along K (torch's default) and in fast-accumulation mode."""
    one = torch.ones((), device="cuda", dtype=torch.float32)
    out = {"bf16": cuda_time(lambda: x @ w.t(), iters=50)}
    for name, sa, sb in (("rowwise", x_scale, w_scale), ("tensor", one, one)):
        for fast in (False, True):
            out[name + ("_fast" if fast else "")] = cuda_time(
                lambda sa=sa, sb=sb, fast=fast: torch._scaled_mm(
                    x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast),
                iters=50)
    return out


def rel_err(x8, w8, x_scale, w_scale, fast: bool) -> float:
    """The row-wise product's error against float32 on the same e4m3 operands: what the
    accumulation mode alone costs."""
    got = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                           use_fast_accum=fast).float()
    want = (x8.float() * x_scale) @ (w8.float() * w_scale.view(-1, 1)).t()
    return ((got - want).norm() / want.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 512, 8192])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    fp8 = torch.float8_e4m3fn
    rows = []
    cols = ("bf16", "rowwise", "rowwise_fast", "tensor", "tensor_fast")
    print(f"{'layer':11s} {'rows':>5s} " + " ".join(f"{c:>12s}" for c in cols)
          + "  (us; TFLOP/s of row-wise fast; error promoted / fast)")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        w8 = w.to(fp8)
        w_scale_row = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8 = x.to(fp8)
            x_scale_row = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
            t = times(x, w, x8, w8, x_scale_row, w_scale_row)
            errs = [rel_err(x8, w8, x_scale_row, w_scale_row, fast) for fast in (False, True)]
            print(f"{name:11s} {m:5d} " + " ".join(f"{t[c] * 1e3:12.1f}" for c in cols)
                  + f"  {2 * m * n * k / t['rowwise_fast'] / 1e9:6.0f}  {errs[0]:.1e} / {errs[1]:.1e}")
            rows.append({"layer": name, "rows": m, "out": n, "in": k,
                         **{f"{c}_us": round(t[c] * 1e3, 2) for c in cols},
                         "rowwise_rel_err": errs[0], "rowwise_fast_rel_err": errs[1]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fp8_scaling", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
