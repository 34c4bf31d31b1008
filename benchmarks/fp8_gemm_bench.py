"""FP8 vs bf16 products on the linear shapes of the FP8 workloads (CUDA).

For each (layer, rows) it times, inside a CUDA graph as the engine's decode steps run:
- bf16: F.linear on the bf16 weight;
- fp8 (torch quant): per-token quantization in torch, then torch._scaled_mm row-wise;
- fp8 (triton quant): the engine's path, one Triton pass to quantize, then _scaled_mm;
- scaled_mm only: the product on activations quantized beforehand (the floor).
It checks the engine's FP8 product against the dequantized reference, and prints a table.

    python benchmarks/fp8_gemm_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagedllm.model_executor.layers.quantization import fp8  # noqa: E402

SHAPES = {  # name: (out_features, in_features)
    "7b.qkv": (12288, 4096), "7b.o": (4096, 4096), "7b.gate_up": (22016, 4096), "7b.down": (4096, 11008),
    "8b.qkv": (6144, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
}


def graph_time_us(fn, iters: int = 50) -> float:
    """Mean microseconds of `fn` replayed `iters` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / iters)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512, 2048, 8192])
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    print(f"{'layer':12} {'rows':>5} {'bf16 us':>8} {'fp8 torchq':>10} {'fp8 tritonq':>11} "
          f"{'mm only':>8} {'speedup':>8} {'rel err':>8}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = fp8.quantize_rows(w)
        wref = fp8.dequantize(wq, ws, k, torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_tokens(x)
            t_bf16 = graph_time_us(lambda: F.linear(x, w))  # noqa: B023

            def torch_path():
                q, s = fp8.quantize_tokens_torch(x)  # noqa: B023
                return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.view(1, -1),  # noqa: B023
                                        out_dtype=torch.bfloat16)

            t_torchq = graph_time_us(torch_path)
            t_engine = graph_time_us(lambda: fp8.scaled_mm(x, wq, ws, k))  # noqa: B023
            t_mm = graph_time_us(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs,  # noqa: B023
                                                          scale_b=ws.view(1, -1),  # noqa: B023
                                                          out_dtype=torch.bfloat16))
            ref = x.float() @ wref.float().t()
            err = ((fp8.scaled_mm(x, wq, ws, k).float() - ref).norm() / ref.norm()).item()
            row = {"layer": name, "rows": m, "out": n, "in": k, "bf16_us": round(t_bf16, 2),
                   "fp8_torch_quant_us": round(t_torchq, 2), "fp8_engine_us": round(t_engine, 2),
                   "scaled_mm_only_us": round(t_mm, 2), "speedup": round(t_bf16 / t_engine, 3),
                   "rel_err": round(err, 4)}
            rows_out.append(row)
            print(f"{name:12} {m:5d} {t_bf16:8.1f} {t_torchq:10.1f} {t_engine:11.1f} {t_mm:8.1f} "
                  f"{t_bf16 / t_engine:7.2f}x {err:8.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fp8_gemm", "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
