"""What the batch-invariant mode costs: the same workload (gpu-7b's shape on CUDA,
cpu-smol on CPU) with the mode off and on, in one process, one after the other.

    python benchmarks/batch_invariant_bench.py --workload gpu-7b [--num-prompts 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from pagedllm.entrypoints.bench_report import environment, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpu-7b")
    ap.add_argument("--num-prompts", type=int)
    ap.add_argument("--output-json")
    args, rest = ap.parse_known_args()
    results = {}
    for mode in ("default", "batch_invariant"):
        out = f"/tmp/bi-bench-{mode}.json"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "throughput",
               "--workload", args.workload, "--output-json", out, *rest]
        if args.num_prompts:
            cmd += ["--num-prompts", str(args.num_prompts)]
        if mode == "batch_invariant":
            cmd.append("--batch-invariant")
        subprocess.run(cmd, check=True)
        with open(out) as f:
            results[mode] = json.load(f)["results"]["pagedllm"]
    ratio = results["batch_invariant"]["output_tokens_per_s"] / results["default"]["output_tokens_per_s"]
    print(f"default {results['default']['output_tokens_per_s']:.1f} tok/s, batch-invariant "
          f"{results['batch_invariant']['output_tokens_per_s']:.1f} tok/s: {ratio:.3f}x")
    if args.output_json:
        write_json(args.output_json, {"benchmark": "batch_invariant_cost", "workload": args.workload,
                                      "environment": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")), "results": results,
                                      "invariant_over_default": round(ratio, 4)})


if __name__ == "__main__":
    main()
