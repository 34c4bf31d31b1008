"""What a long prompt does to the streams running beside it, for several values of
`max_prefill_tokens_with_decodes` (the default of that setting was chosen from this).

N sequences decode; then one long prompt arrives. For each cap it prints the median time of
a decode step alone, the median and largest step time while the prompt is read (what each
stream's inter-token latency becomes), and how long the prompt took to read (its time to
first token); the last line is the prompt read with no decode beside it.

    python benchmarks/long_prefill_itl.py --shape llama3-8b --decodes 64 --prompt 32768 \
        --caps 0,256,512,1024,2048 [--json out.json]     # GPU, random weights
    python benchmarks/long_prefill_itl.py --decodes 64 --prompt 1800 --caps 0,128,256 \
        --max-model-len 2048                             # CPU, the default SmolLM2

Step times are wall-clock between successive `step()` returns; with async scheduling that
is the device's step time once the pipeline is full.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import write_arch_config

# Llama-3.1-8B's shape (public model card), random weights: only shapes decide speed.
LLAMA3_8B_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def drain(llm: LLM) -> None:
    engine = llm.engine
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(req.request_id.split("#")[0])
    while engine.has_unfinished_requests():
        engine.step()


def run_case(llm: LLM, cap: int, decodes: int, prompt_len: int, decode_len: int, rng) -> dict:
    engine, sched = llm.engine, llm.engine.scheduler
    sched.max_prefill_tokens_with_decodes = cap
    vocab = engine.executor.vocab_size
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    tag = f"c{cap}-{rng.randrange(1 << 30)}"
    for i in range(decodes):
        engine.add_request(f"{tag}-d{i}", None, [rng.randrange(vocab) for _ in range(decode_len)],
                           params)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    alone = []
    for _ in range(12 if decodes else 0):
        t = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - t)
    long_id = f"{tag}-long"
    engine.add_request(long_id, None, [rng.randrange(vocab) for _ in range(prompt_len)],
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps, t0 = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        if any(o.request_id == long_id for o in outs):
            break
    ttft = time.perf_counter() - t0
    drain(llm)
    return {"cap": cap, "decodes": decodes, "prompt": prompt_len,
            "decode_step_ms": round(statistics.median(alone) * 1e3, 2) if alone else None,
            "step_median_ms": round(statistics.median(steps) * 1e3, 2),
            "step_max_ms": round(max(steps) * 1e3, 2), "steps": len(steps),
            "prompt_read_s": round(ttft, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["llama3-8b"], help="random weights of this shape "
                   "(default: the default model)")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--decode-len", type=int, default=1024, help="prompt tokens of each stream")
    p.add_argument("--prompt", type=int, default=32768, help="tokens of the long prompt")
    p.add_argument("--caps", default="0,256,512,1024,2048")
    p.add_argument("--max-model-len", type=int, default=40960)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    kw = dict(max_model_len=a.max_model_len, max_num_seqs=max(a.decodes + 1, 8), seed=0)
    if a.shape:
        kw.update(model=write_arch_config(LLAMA3_8B_CONFIG), load_format="dummy",
                  skip_tokenizer_init=True)
    llm = LLM(**kw)
    print(json.dumps(llm.engine.describe()), flush=True)
    rng = random.Random(0)
    caps = [int(c) for c in a.caps.split(",")]
    run_case(llm, caps[-1], a.decodes, min(a.prompt, 4096), a.decode_len, rng)  # warm-up
    results = []
    for cap in caps:
        r = run_case(llm, cap, a.decodes, a.prompt, a.decode_len, rng)
        print(json.dumps(r), flush=True)
        results.append(r)
    r = run_case(llm, 0, 0, a.prompt, a.decode_len, rng)
    print(json.dumps(r), flush=True)
    results.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"describe": llm.engine.describe(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
