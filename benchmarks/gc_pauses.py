"""Python's garbage collection during an engine run, with the startup heap frozen (the
engine's default, pagedllm/heap.py) and thawed: passes and time per generation, and the
longest gaps between steps. The host's side only, so it runs on the CPU with a tiny
random model; what a pause costs a GPU run is the device's idle time between launches
(benchmarks/host_sync_check.py on CUDA).

    python benchmarks/gc_pauses.py --num-prompts 512 --output-len 2048 [--modes thawed frozen]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import write_arch_config

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


class GCPasses:
    """Python's garbage-collection passes while the `with` block runs: `passes` maps a
    generation to [passes, seconds] (host_sync_check.py counts them the same way)."""

    def __init__(self) -> None:
        self.passes: dict[int, list] = {}
        self._started = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            row = self.passes.setdefault(info["generation"], [0, 0.0])
            row[0] += 1
            row[1] += time.perf_counter() - self._started

    def __enter__(self) -> GCPasses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)


def set_heap(mode: str) -> int:
    """The startup heap "frozen" (after a collection, as pagedllm/heap.py does) or "thawed"
    (gc.unfreeze()) for the next timed run; returns the objects now frozen."""
    if mode == "frozen":
        gc.collect()
        gc.freeze()
    else:
        gc.unfreeze()
    return gc.get_freeze_count()


def timed_run(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    steps: list[float] = []
    engine = llm.engine
    step = engine.step

    def traced(*a, **k):
        steps.append(time.perf_counter())
        return step(*a, **k)

    engine.step = traced
    t0 = time.perf_counter()
    try:
        with GCPasses() as gcp:
            llm.generate(prompts, params)
    finally:
        engine.step = step
    elapsed = time.perf_counter() - t0
    gaps = sorted((b - a for a, b in zip(steps, steps[1:], strict=False)), reverse=True)
    return {"elapsed_s": round(elapsed, 3), "steps": len(steps),
            "median_step_ms": round(gaps[len(gaps) // 2] * 1e3, 2) if gaps else None,
            "longest_steps_ms": [round(g * 1e3, 1) for g in gaps[:5]],
            "gc": {f"gen{g}": {"passes": c, "ms": round(s * 1e3, 1)} for g, (c, s) in sorted(gcp.passes.items())}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--modes", nargs="+", choices=["frozen", "thawed"], default=["thawed", "frozen"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n, out = args.num_prompts, args.output_len
    llm = LLM(model=write_arch_config(TINY), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
              max_num_seqs=n, async_scheduling=True,
              num_kv_blocks=n * (args.input_len + out) // 16 + 2 * n)
    prompts = [{"prompt_token_ids": [1 + (i + j) % 997 for j in range(args.input_len)]} for i in range(n)]
    params = SamplingParams(temperature=1.0, max_tokens=out, ignore_eos=True)
    llm.generate(prompts[:4], params)
    results = {}
    for mode in args.modes:
        frozen = set_heap(mode)
        r = timed_run(llm, prompts, params)
        r["objects_frozen"] = frozen
        results[mode] = r
        print(f"heap {mode:6s}: {r['elapsed_s']:8.2f} s, {r['steps']} steps, median {r['median_step_ms']} ms, "
              f"longest {r['longest_steps_ms']} ms, {r['objects_frozen']} objects frozen")
        for g, v in r["gc"].items():
            print(f"    {g}: {v['passes']:6d} passes {v['ms']:9.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gc_pauses", "num_prompts": n, "input_len": args.input_len,
                       "output_len": out, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
