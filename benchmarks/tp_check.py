"""Tensor parallelism on real GPUs: TP=N greedy tokens against TP=1 on one random
Llama-2-7B-shaped checkpoint in bf16 (fewer layers by default, so it is quick to write).

The checkpoint is written once with transformers (random init, fixed seed), so both runs
read the same weights. bf16 all-reduces sum partial products in another order than one
GPU does, so tokens may part after a near-tie: a divergence counts as expected only when
TP=1's top two logprobs at that step are within `--tie-margin`.

    python benchmarks/tp_check.py --tp 2 [--layers 8] [--prompts 16] [--max-tokens 32]
Prints a table; writes $OUT/tp_check.json when OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.entrypoints.bench_workloads import LLAMA2_7B_CONFIG  # noqa: E402


def write_checkpoint(path: str, layers: int, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in LLAMA2_7B_CONFIG.items() if k not in ("architectures", "model_type")}
    cfg["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def run(path: str, tp: int, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[dict]]]:
    llm = LLM(model=path, dtype="bfloat16", tensor_parallel_size=tp, skip_tokenizer_init=True,
              max_model_len=1024, gpu_memory_utilization=0.6)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tie-margin", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 32000) for _ in range(rng.randint(8, 200))] for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as path:
        write_checkpoint(path, args.layers, args.seed)
        ref = run(path, 1, prompts, args.max_tokens)
        got = run(path, args.tp, prompts, args.max_tokens)
    rows, bad = [], 0
    for i, ((rt, rlp), (gt, _)) in enumerate(zip(ref, got, strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(rt, gt, strict=True)) if a != b), None)
        margin = None
        if first is not None:
            top = sorted(rlp[first].values(), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else float("inf")
            bad += margin >= args.tie_margin
        rows.append({"prompt": i, "equal": first is None, "first_divergence": first, "tp1_top2_margin": margin})
        print(f"prompt {i:3d}: " + ("equal" if first is None else f"parts at token {first} (margin {margin:.3f})"))
    summary = {"tp": args.tp, "layers": args.layers, "prompts": args.prompts, "max_tokens": args.max_tokens,
               "equal": sum(r["equal"] for r in rows), "unexplained_divergences": bad, "rows": rows,
               "device": torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count()}
    print(f"{summary['equal']}/{args.prompts} equal; divergences not at a near-tie: {bad}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tp_check.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
