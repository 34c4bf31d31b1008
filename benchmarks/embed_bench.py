"""Embedding throughput: pagedllm's pooling runner against sentence-transformers `encode`,
on the same random-weight Qwen3-0.6B (QWEN3_0_6B_CONFIG), the same inputs, in one run.

The checkpoint is built once in a temporary folder: random bf16 weights saved by
transformers, a word-level tokenizer (id i is the word `w<i>`, so an input of n words is
exactly n tokens with no special tokens added), and sentence-transformers' modules.json /
1_Pooling (last token) / Normalize, as Qwen3-Embedding has. sentence-transformers loads that
folder (its Transformer module over the same weights); pagedllm serves it with
runner="pooling" and reads the same pooling files. Both get the same texts as input.

sentence-transformers runs first and is freed before pagedllm starts (pagedllm sizes its
KV pool from the free GPU memory). Each side runs once to warm up, then `--repeats` times;
the best run counts. The vectors are compared too (cosine similarity, bf16).

    python benchmarks/embed_bench.py [--num-inputs 2048] [--input-len 256]
        [--st-batch-size 32] [--output-json FILE]

Target: pagedllm >= 3x sentence-transformers' inputs/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from pagedllm.entrypoints.bench_report import args_dict, environment, write_json
from pagedllm.entrypoints.bench_workloads import QWEN3_0_6B_CONFIG, write_word_tokenizer


def build_checkpoint(directory: str, seed: int, num_layers: int | None = None) -> None:
    """Random Qwen3-0.6B weights, the word tokenizer, and the sentence-transformers files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in QWEN3_0_6B_CONFIG.items() if k not in ("architectures", "model_type")}
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    config = AutoConfig.for_model("qwen3", **cfg)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    del model
    write_word_tokenizer(directory, QWEN3_0_6B_CONFIG["vocab_size"])
    tok_config = os.path.join(directory, "tokenizer_config.json")
    with open(tok_config) as f:
        tok = json.load(f)
    with open(tok_config, "w") as f:  # sentence-transformers pads its batches
        json.dump({**tok, "pad_token": "w0"}, f)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(directory, "1_Pooling"))
    os.makedirs(os.path.join(directory, "2_Normalize"))
    pooling = {"word_embedding_dimension": QWEN3_0_6B_CONFIG["hidden_size"],
               "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True,
               "include_prompt": True}
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    with open(os.path.join(directory, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 4096, "do_lower_case": False}, f)


def make_texts(n: int, length: int, vocab: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(n, length))
    return [" ".join(f"w{i}" for i in row) for row in ids]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_time(fn, repeats: int, device: str) -> tuple[float, object]:
    fn()  # warm-up (kernels compiled, allocator primed)
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_sentence_transformers(directory: str, texts: list[str], args) -> tuple[float, np.ndarray, dict]:
    """Best time, vectors, and what ran. The model is freed on return."""
    from sentence_transformers import SentenceTransformer

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    st = SentenceTransformer(directory, device=args.device, model_kwargs={"dtype": dtype})
    seconds, vecs = best_time(lambda: st.encode(texts, batch_size=args.st_batch_size,
                                                convert_to_numpy=True), args.repeats, args.device)
    info = {"batch_size": args.st_batch_size,
            "attn_implementation": getattr(st[0].auto_model.config, "_attn_implementation", None)}
    return seconds, vecs, info


def bench_pagedllm(directory: str, texts: list[str], args) -> tuple[float, np.ndarray, dict]:
    from pagedllm import LLM

    kw = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.device == "cuda" else {}
    llm = LLM(model=directory, runner="pooling",
              dtype="bfloat16" if args.device == "cuda" else "float32", max_model_len=4096,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
              device=args.device, **kw)
    seconds, outs = best_time(lambda: llm.embed(texts), args.repeats, args.device)
    assert all(len(o.prompt_token_ids) == args.input_len for o in outs)
    vecs = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
    return seconds, vecs, {"max_num_batched_tokens": args.max_num_batched_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-inputs", type=int, default=2048)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--st-batch-size", type=int, default=32,
                    help="sentence-transformers' encode batch size (its default: 32)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke run)")
    ap.add_argument("--num-hidden-layers", type=int,
                    help="fewer layers than Qwen3-0.6B's 28 (smoke runs only)")
    ap.add_argument("--checkpoint-dir", help="reuse (or keep) the built checkpoint here")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("embed_bench needs a CUDA device (or --device cpu for a smoke run)")

    directory = args.checkpoint_dir or tempfile.mkdtemp(prefix="pagedllm-embed-bench-")
    if not os.path.exists(os.path.join(directory, "modules.json")):
        os.makedirs(directory, exist_ok=True)
        t = time.perf_counter()
        build_checkpoint(directory, args.seed, args.num_hidden_layers)
        print(f"checkpoint built in {time.perf_counter() - t:.1f} s: {directory}", flush=True)
    texts = make_texts(args.num_inputs, args.input_len, QWEN3_0_6B_CONFIG["vocab_size"], args.seed)
    tokens = args.num_inputs * args.input_len
    results: dict = {}
    try:
        st_time, st_vecs, st_info = bench_sentence_transformers(directory, texts, args)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        ours_time, ours, our_info = bench_pagedllm(directory, texts, args)
        for name, seconds, info in (("sentence_transformers", st_time, st_info),
                                    ("pagedllm", ours_time, our_info)):
            results[name] = {"seconds": round(seconds, 3),
                             "inputs_per_s": round(args.num_inputs / seconds, 1),
                             "tokens_per_s": round(tokens / seconds, 1), **info}
            print(f"{name}: {results[name]}", flush=True)
        cos = np.sum(ours * st_vecs, axis=1) / (np.linalg.norm(ours, axis=1)
                                               * np.linalg.norm(st_vecs, axis=1))
        summary = {"speedup": round(st_time / ours_time, 3), "target": 3.0,
                   "cosine_min": round(float(cos.min()), 5),
                   "cosine_mean": round(float(cos.mean()), 5)}
        print(json.dumps(summary), flush=True)
    finally:
        if not args.checkpoint_dir:
            shutil.rmtree(directory, ignore_errors=True)
    if args.output_json:
        write_json(args.output_json, {
            "benchmark": "embed", "model": "Qwen3-0.6B shape, random bf16 weights, last-token "
            "pooling + normalize", "num_inputs": args.num_inputs, "input_len": args.input_len,
            "args": args_dict(args), "environment": environment(torch.device(args.device)),
            "results": results, "summary": summary})


if __name__ == "__main__":
    main()
