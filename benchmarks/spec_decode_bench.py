"""What n-gram speculative decoding buys on CPU with the default model (SmolLM2-135M).

Two engines in one run, one without and one with `speculative_config` (n-gram), on two
workloads, greedy so that both must give the same tokens:

- copy: batch 1, "Repeat the following text exactly: <a paragraph>", where the answer is
  in the prompt and drafts are mostly accepted (target: >= 1.8x the tokens per second);
- batch16: 16 ordinary prompts decoding together, where drafts are mostly rejected and
  dynamic speculation must keep the cost away (target: >= 0.97x).

Each case runs once to warm up and then `--repeats` times alternating the engines; the
best time of each counts (the 2-core CPU is shared, the best run is the least disturbed).

    python benchmarks/spec_decode_bench.py [--k 4] [--repeats 2] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_report import environment, write_json

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the "
    "great clockwork that turned the lens, trimmed the wick, and polished the brass until "
    "it shone. Ships passing the rocky headland relied on the steady flash that swept "
    "across the water every ten seconds. In the winter storms he kept watch through the "
    "night, writing in his logbook the names of the vessels he saw and the state of the sea."
)
ORDINARY = [
    "Write a short poem about the ocean.", "Explain how a rainbow forms.",
    "Give three tips for learning a new language.", "What is the capital of Japan?",
    "Describe a cat to someone who has never seen one.", "Why do leaves change colour in autumn?",
    "Tell me a fun fact about space.", "How do I make a cup of tea?",
    "What are the benefits of regular exercise?", "Summarise the plot of Cinderella.",
    "Name some famous painters and their works.", "How does a bicycle stay upright?",
    "What should I pack for a weekend hike?", "Explain photosynthesis simply.",
    "Write a haiku about coffee.", "What is the difference between weather and climate?",
]


def chat_prompt(llm: LLM, text: str) -> dict:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)
    return {"prompt_token_ids": list(tok.encode(text, add_special_tokens=False))}


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list[list[int]], int]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return elapsed, toks, sum(len(x) for x in toks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--copy-tokens", type=int, default=160)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--output-json")
    args = ap.parse_args()

    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    common = {"max_model_len": 2048, "seed": 0, "kv_cache_memory": "512MiB"}
    engines = {"base": LLM(**common), "spec": LLM(**common, speculative_config=spec)}
    base = engines["base"]
    cases = {
        "copy_b1": ([chat_prompt(base, "Repeat the following text exactly: " + PARAGRAPH)],
                    SamplingParams(temperature=0, max_tokens=args.copy_tokens)),
        "ordinary_b16": ([chat_prompt(base, p) for p in ORDINARY],
                         SamplingParams(temperature=0, max_tokens=args.batch_tokens, ignore_eos=True)),
    }
    results: dict = {}
    for case, (prompts, params) in cases.items():
        best: dict[str, float] = {}
        toks: dict[str, list] = {}
        stats0 = engines["spec"].engine.stats()
        for llm in engines.values():
            timed(llm, prompts, params)  # warm-up (the prefix cache is warm for both)
        for _ in range(args.repeats):
            for name, llm in engines.items():
                elapsed, toks[name], n = timed(llm, prompts, params)
                best[name] = min(best.get(name, float("inf")), elapsed)
        s = engines["spec"].engine.stats()
        drafts = s.spec_num_drafts - stats0.spec_num_drafts
        accepted = s.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
        proposed = s.spec_num_draft_tokens - stats0.spec_num_draft_tokens
        results[case] = {
            "batch": len(prompts), "output_tokens": n,
            "base_tok_s": round(n / best["base"], 2), "spec_tok_s": round(n / best["spec"], 2),
            "speedup": round(best["base"] / best["spec"], 3),
            "same_tokens": toks["base"] == toks["spec"],
            "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        }
        r = results[case]
        print(f"{case}: base {r['base_tok_s']} tok/s, spec {r['spec_tok_s']} tok/s, "
              f"x{r['speedup']}, same tokens {r['same_tokens']}, accepted {accepted}/{proposed}, "
              f"mean acceptance length {r['mean_acceptance_length']}", flush=True)
    summary = {"copy_b1_speedup": results["copy_b1"]["speedup"],
               "ordinary_b16_speedup": results["ordinary_b16"]["speedup"]}
    print(json.dumps(summary))
    if args.output_json:
        write_json(args.output_json, {"benchmark": "spec_decode", "model": "SmolLM2-135M-Instruct Q4_1",
                                      "speculative_config": spec, "environment": environment(torch.device("cpu")),
                                      "results": results, "summary": summary})


if __name__ == "__main__":
    main()
