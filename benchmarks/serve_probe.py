"""Where served throughput goes: the front end (AsyncLLM) driven directly, without HTTP.

Runs the gpu-7b shape (random weights, word tokenizer) through AsyncLLM with its core in a
process of its own, at several concurrencies, and prints output tok/s with the CPU time the
front-end process and the core process used. If this reaches the offline figure, what the
served runs lose is HTTP, SSE and the benchmark client; if not, the front end or the
channel is the bound.

    python benchmarks/serve_probe.py --concurrency 64 256 [--no-detokenize]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import psutil

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.bench_workloads import (
    LLAMA2_7B_CONFIG,
    write_arch_config,
    write_word_tokenizer,
)
from pagedllm.sampling_params import SamplingParams


async def run(engine: AsyncLLM, concurrency: int, num: int, out_len: int, detok: bool, tag: str) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(256)] for _ in range(num)]
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=1.0, detokenize=detok)
    sem = asyncio.Semaphore(concurrency)
    chunks = 0

    async def one(i: int) -> int:
        nonlocal chunks
        async with sem:
            last = None
            async for out in engine.generate(f"{tag}-{i}", None, prompts[i], params):
                chunks += 1
                last = out
            return len(last.outputs[0].token_ids)

    me = psutil.Process()
    core = [c for c in me.children() if "spawn_main" in " ".join(c.cmdline())]
    cpu0 = me.cpu_times()
    core0 = core[0].cpu_times() if core else None
    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*(one(i) for i in range(num))))
    dt = time.perf_counter() - t0
    cpu1 = me.cpu_times()
    fe = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / dt
    row = {"concurrency": concurrency, "requests": num, "tok_s": round(n / dt, 1), "seconds": round(dt, 2),
           "chunks_per_token": round(chunks / n, 3), "frontend_cpu": round(fe, 2)}
    if core:
        c1 = core[0].cpu_times()
        row["core_cpu"] = round((c1.user + c1.system - core0.user - core0.system) / dt, 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--no-detokenize", action="store_true")
    p.add_argument("--in-process", action="store_true")
    args = p.parse_args()
    d = tempfile.mkdtemp()
    write_arch_config(LLAMA2_7B_CONFIG, d)
    write_word_tokenizer(d, LLAMA2_7B_CONFIG["vocab_size"])
    engine = AsyncLLM(EngineConfig(model=d, load_format="dummy", dtype="bfloat16", max_model_len=4096),
                      in_process=args.in_process)

    async def go() -> None:
        await run(engine, 64, 64, 16, not args.no_detokenize, "warm")
        for c in args.concurrency:
            print(await run(engine, c, max(c, 256) if c < 256 else 2 * c, args.output_len,
                            not args.no_detokenize, f"c{c}"), flush=True)

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
