"""What a JSON-Schema constraint costs the engine: gpu-7b's shape (random weights, a
byte-level tokenizer so that JSON can be written) with every request free, every request
constrained, and half and half.

The schema makes every constrained answer the same length (an object holding a 100-digit
array, compact JSON), so the free requests are given that many tokens and each run does
the same work. Reported: output tok/s per run, the constrained answers that parse and
validate, and the free requests' time per output token alone and beside constrained ones.

    python benchmarks/structured_bench.py [--num-prompts 256] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_report import environment, write_json
from pagedllm.entrypoints.bench_workloads import (
    LLAMA2_7B_CONFIG,
    write_arch_config,
    write_byte_tokenizer,
)
from pagedllm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9},
        "readings": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 100, "maxItems": 100},
    },
    "required": ["id", "readings"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"id", "readings"} and v["id"] in range(10)
            and len(v["readings"]) == 100 and all(x in range(10) for x in v["readings"]))


def run(llm: LLM, prompts: list[list[int]], constrained: list[bool], max_tokens: int) -> dict:
    params = []
    for c in constrained:
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if c else None
        params.append(SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                     ignore_eos=not c, structured_outputs=so))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = {True: [], False: []}
    lengths = {True: [], False: []}
    ok = 0
    for o, c in zip(outs, constrained, strict=True):
        n = len(o.outputs[0].token_ids)
        lengths[c].append(n)
        m = o.metrics or {}
        if n > 1 and "first_token_time" in m and "finished_time" in m:
            tpot[c].append((m["finished_time"] - m["first_token_time"]) / (n - 1))
        if c and valid(o.outputs[0].text):
            ok += 1
    return {"seconds": round(dt, 3), "output_tokens": tokens, "output_tok_s": round(tokens / dt, 1),
            "constrained": sum(constrained), "constrained_valid": ok,
            "mean_len_constrained": float(np.mean(lengths[True])) if lengths[True] else None,
            "mean_len_free": float(np.mean(lengths[False])) if lengths[False] else None,
            "free_tpot_ms": round(1000 * float(np.mean(tpot[False])), 3) if tpot[False] else None,
            "constrained_tpot_ms": (round(1000 * float(np.mean(tpot[True])), 3)
                                    if tpot[True] else None)}


def mean(results: dict, run: str, field: str) -> float:
    """A figure of a run and of its repeat (`<run>_again`), averaged."""
    return (results[run][field] + results[run + "_again"][field]) / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-json")
    ap.add_argument("--half-only", action="store_true",
                    help="only the free and half-constrained runs (what free requests lose)")
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    write_arch_config(LLAMA2_7B_CONFIG, d)
    write_byte_tokenizer(d, LLAMA2_7B_CONFIG["vocab_size"])
    llm = LLM(model=d, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    rng = random.Random(0)
    prompts = [[rng.randrange(256, 32000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    n = args.num_prompts
    # Warm-up: compiles the grammar once and runs every path at the full batch (the mask
    # kernel is compiled per shape on first use; a first timed run would pay for it).
    run(llm, prompts[:8], [True, False] * 4, 64)
    if args.half_only:
        length = 324  # the schema's answer: {"id": d, "readings": [d, ... 100 digits]}
        run(llm, prompts, [i % 2 == 0 for i in range(n)], length)
        results = {"free": run(llm, prompts, [False] * n, length)}
        results["half"] = run(llm, prompts, [i % 2 == 0 for i in range(n)], length)
        results["half_again"] = run(llm, prompts, [i % 2 == 0 for i in range(n)], length)
        results["free_again"] = run(llm, prompts, [False] * n, length)
        summary = {"free_half_tpot_over_free_tpot": round(
            mean(results, "half", "free_tpot_ms") / mean(results, "free", "free_tpot_ms"), 4)}
        _report(results, summary, args)
        return
    run(llm, prompts, [True] * n, 400)
    results = {"all_constrained": run(llm, prompts, [True] * n, 400)}
    length = round(results["all_constrained"]["mean_len_constrained"])
    results["free"] = run(llm, prompts, [False] * n, length)
    results["half"] = run(llm, prompts, [i % 2 == 0 for i in range(n)], length)
    results["all_constrained_again"] = run(llm, prompts, [True] * n, 400)
    results["half_again"] = run(llm, prompts, [i % 2 == 0 for i in range(n)], length)
    results["free_again"] = run(llm, prompts, [False] * n, length)
    # The same two runs with the step split off (the mask filled before the step is
    # launched, after the previous one was read): what the split is worth.
    llm.engine.core.executor.supports_deferred_sampling = False
    results["all_constrained_unsplit"] = run(llm, prompts, [True] * n, 400)
    results["half_unsplit"] = run(llm, prompts, [i % 2 == 0 for i in range(n)], length)
    free = mean(results, "free", "output_tok_s")
    free_tpot = mean(results, "free", "free_tpot_ms")
    summary = {
        "constrained_over_free": round(mean(results, "all_constrained", "output_tok_s") / free, 4),
        "half_over_free": round(mean(results, "half", "output_tok_s") / free, 4),
        "free_half_tpot_over_free_tpot": round(mean(results, "half", "free_tpot_ms") / free_tpot,
                                               4),
        "tokens_per_constrained_answer": length,
        "unsplit_constrained_over_free": round(
            results["all_constrained_unsplit"]["output_tok_s"] / free, 4),
        "unsplit_free_half_tpot_over_free_tpot": round(
            results["half_unsplit"]["free_tpot_ms"] / free_tpot, 4),
    }
    _report(results, summary, args)


def _report(results: dict, summary: dict, args: argparse.Namespace) -> None:
    print(f"{'run':<16}{'tok/s':>10}{'valid':>12}{'free TPOT ms':>14}{'constr TPOT ms':>16}")
    for name, r in results.items():
        print(f"{name:<16}{r['output_tok_s']:>10}{r['constrained_valid']:>6}/{r['constrained']:<5}"
              f"{str(r['free_tpot_ms']):>14}{str(r['constrained_tpot_ms']):>16}")
    print(json.dumps(summary))
    if args.output_json:
        write_json(args.output_json, {"benchmark": "structured_outputs",
                                      "environment": environment(torch.device("cuda")),
                                      "schema": SCHEMA, "results": results, "summary": summary})


if __name__ == "__main__":
    main()
