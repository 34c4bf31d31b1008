"""One MoE layer of a one-token decode step (CUDA), Qwen3-30B-A3B's shape: the fused path
(route_align, the two grouped GEMMs, torch's k-row sum) against skinny_moe's two kernels
at their default tiles and at other settings.

Each path runs inside a CUDA graph over enough layers of distinct experts to pass the L2
(a step reads each layer's routed experts from memory once), replayed 20 times; the
figure is microseconds a layer and the routed experts' bytes over that time. Every
setting is checked against the fused path first.

    python benchmarks/skinny_moe_bench.py [--layers 6] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from pagedllm.model_executor.layers import fused_moe, skinny_moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from skinny_gemm_bench import per_call_us  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6, help="distinct layers in the graph (6: 4.8 GB)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w13s = [torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dtype) * 0.02 for _ in range(args.layers)]
    w2s = [torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dtype) * 0.02 for _ in range(args.layers)]
    x = torch.randn(1, HIDDEN, device=dev, dtype=dtype)
    logits = [torch.randn(1, EXPERTS, device=dev, dtype=dtype) for _ in range(args.layers)]
    cfg = fused_moe.pick_config(TOP_K, EXPERTS, HIDDEN, INTER, TOP_K)

    def fused(i):
        weights, ids, aligned = fused_moe.route_align(logits[i], TOP_K, True, cfg["BM"], dtype)
        return fused_moe.fused_experts(x, w13s[i], w2s[i], weights, ids, config=cfg, aligned=aligned)

    def skinny(i, c=None):
        return skinny_moe.routed_experts(x, w13s[i], w2s[i], logits=logits[i], top_k=TOP_K, renormalise=True,
                                         weights_dtype=dtype, config=c)

    routed_bytes = TOP_K * 3 * HIDDEN * INTER * 2
    ref = fused(0).float()
    rows = [{"path": "fused (route_align + grouped GEMMs + sum)", "us": per_call_us(fused, args.layers)}]
    default = skinny_moe.launch_config(HIDDEN, INTER)
    # the two kernels' settings swept one kernel at a time (compiles are the cost here)
    settings = [default] + [dict(default, gate_bn=bn, gate_bk=bk) for bn, bk in itertools.product((2, 4, 8), (512, 1024))
                            if (bn, bk) != (default["gate_bn"], default["gate_bk"])]
    settings += [dict(default, down_bn=bn, down_bk=bk) for bn, bk in itertools.product((1, 2, 4), (128, 256))
                 if (bn, bk) != (default["down_bn"], default["down_bk"])]
    for c in settings:
        err = (skinny(0, c).float() - ref).abs().max().item()
        if err > 2e-2 * max(1.0, ref.abs().max().item()):
            raise SystemExit(f"skinny_moe {c}: max difference from the fused path {err}")
        name = "skinny default" if c is default else "skinny"
        rows.append({"path": name, "config": c, "us": per_call_us(lambda i, c=c: skinny(i, c), args.layers)})
    for r in rows:
        r["us"] = round(r["us"], 2)
        r["TBps"] = round(routed_bytes / r["us"] / 1e6, 2)
    best = min(rows[1:], key=lambda r: r["us"])
    for r in rows[:2] + [best]:
        print(f"{r['path']:45s} {r['us']:7.2f} us a layer ({r['TBps']:.2f} TB/s)  {r.get('config', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "one MoE layer at one token (Qwen3-30B-A3B shape): fused path vs skinny_moe",
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "best": best, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
