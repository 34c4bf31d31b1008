"""Where a step's time goes on the GPU: host-side engine work vs device time.

Runs a BENCHMARKS.md workload (dummy weights) under cProfile and prints the engine's
hottest functions, then times, with CUDA events, a replayed decode graph (the device time
of one decode step) at a few batch sizes and context lengths, and the attention kernel
alone. Usage: python benchmarks/profile_decode.py --workload gpu-0.6b [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import WORKLOADS, random_dataset, write_arch_config


def cuda_time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpu-0.6b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--skip-workload", action="store_true", help="only the kernel and graph timings")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    path = write_arch_config(w.arch_config)
    llm = LLM(model=path, load_format="dummy", dtype=w.dtype, skip_tokenizer_init=True)
    vocab = llm.engine.executor.vocab_size
    out_range = w.output_range if args.max_output is None else (min(w.output_range[0], args.max_output), args.max_output)
    data = random_dataset(args.num_prompts, w.input_range, out_range, vocab, 0)
    prompts = [{"prompt_token_ids": p} for p in data.prompts]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature) for n in data.output_lens]
    llm.generate(prompts[:4], params[:4])
    torch.cuda.synchronize()

    # 1. Host profile of the whole workload.
    steps = {"n": 0}
    engine = llm.engine
    orig = engine.step

    def counting_step(*a, **k):
        steps["n"] += 1
        return orig(*a, **k)

    engine.step = counting_step
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    n = 8 if args.skip_workload else len(prompts)
    llm.generate(prompts[:n], params[:n])
    prof.disable()
    wall = time.perf_counter() - t0
    out_tokens = sum(data.output_lens)
    print(f"\n== {args.workload}: {wall:.2f} s, {steps['n']} steps, {out_tokens / wall:.0f} output tok/s "
          f"(under cProfile), {wall / steps['n'] * 1000:.2f} ms/step")
    if not args.skip_workload:
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)

    guard = torch.inference_mode()  # the runner's tensors are inference tensors
    guard.__enter__()
    # 2. Device time of one replayed decode step.
    runner = engine.executor.runner
    graphs = runner.graphs
    bs = runner.block_size
    if graphs is not None:
        print("\n== decode graph replay (device ms per step)")
        for b in (1, 64, 256):
            for ctx in (128, 512, 1024):
                nblk = -(-ctx // bs)
                tables = np.arange(b * nblk, dtype=np.int32).reshape(b, nblk) % engine.kv.num_blocks
                arrays = {"ids": np.zeros(b, np.int64), "positions": np.full(b, ctx - 1),
                          "slots": tables[:, -1].astype(np.int64) * bs + (ctx - 1) % bs,
                          "ctx_len": np.full(b, ctx), "tables": tables}
                ms = cuda_time(lambda arrays=arrays, g=graphs: g.run(arrays))
                print(f"batch {b:4d} ctx {ctx:5d}: {ms:7.3f} ms  -> {b / ms * 1000:9.0f} tok/s")

    # 3. Attention kernel alone, one layer, decode batch 256.
    from pagedllm.attention.metadata import AttentionMetadata

    s = runner.model.shape
    k_cache, v_cache = runner.kv_caches[0]
    for ctx in (512, 1024):
        b = 256
        nblk = -(-ctx // bs)
        tables = torch.arange(b * nblk, device="cuda", dtype=torch.int32).view(b, nblk) % engine.kv.num_blocks
        meta = AttentionMetadata(
            slot_mapping=torch.full((b,), -1, device="cuda", dtype=torch.int32), num_decode=b,
            block_tables=tables, q_start=torch.arange(b, device="cuda", dtype=torch.int32),
            q_len=torch.ones(b, device="cuda", dtype=torch.int32),
            ctx_len=torch.full((b,), ctx, device="cuda", dtype=torch.int32))
        q = torch.randn(b, s.num_heads, s.head_dim, device="cuda", dtype=k_cache.dtype)
        k = torch.randn(b, s.num_kv_heads, s.head_dim, device="cuda", dtype=k_cache.dtype)
        kv_bytes = 2 * b * ctx * s.num_kv_heads * s.head_dim * k_cache.element_size()
        backend = runner.backend
        default = dict(backend.DECODE_LAUNCH)
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    backend.DECODE_LAUNCH = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
                    try:
                        ms = cuda_time(lambda q=q, k=k, meta=meta, be=backend: be.forward(q, k, k, k_cache, v_cache, meta, 0.1))
                    except Exception as e:  # a launch config the compiler refuses
                        print(f"  {backend.DECODE_LAUNCH}: failed {type(e).__name__}")
                        continue
                    print(f"attention layer, batch 256 ctx {ctx} {backend.DECODE_LAUNCH}: {ms:.3f} ms, "
                          f"{kv_bytes / ms / 1e9:.0f} GB/s of KV (x{s.num_layers} = {ms * s.num_layers:.2f} ms)")
        backend.DECODE_LAUNCH = default


if __name__ == "__main__":
    main()
