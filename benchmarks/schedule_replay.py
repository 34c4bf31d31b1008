"""The engine's scheduler replayed on the CPU over a fixed-length workload, each step priced
by a linear model of the device: what a scheduling choice (the batch cap, the number of
requests, the pool's size, preempted sequences kept instead of recomputed) is worth before
a device run measures it. A model, not a measurement: its parameters come from device
runs (defaults: trt-8b-2k on an H100, benchmarks/results/2026-12-07-gpu-h100-host-trt-8b-2k-*.json,
where 512 x (128 in, 2,048 out) ran at 17,200-18,100 output tok/s and this model gives 17,900).

    python benchmarks/schedule_replay.py --requests 512 3000 --input-len 128 --output-len 2048
        [--max-num-seqs 512 768] [--blocks 63424] [--keep-preempted]

A step costs fixed + per_seq * decodes + per_key * keys the decodes read + per_prompt *
prompt tokens (milliseconds). --keep-preempted prices preempted sequences' recomputed
tokens at nothing (what swapping their pages out and back would approach).
"""

from __future__ import annotations

import argparse

from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler


def replay(requests: int, input_len: int, output_len: int, max_num_seqs: int, blocks: int, block_size: int,
           budget: int, cost: dict, keep_preempted: bool) -> dict:
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs, budget, 1 << 20)
    for i in range(requests):
        s.add_request(Request(request_id=str(i), prompt_token_ids=[1] * input_len, max_tokens=output_len,
                              ignore_eos=True))
    ms = 0.0
    steps = out_tokens = recomputed = 0
    while s.has_unfinished():
        out = s.schedule()
        decodes = keys = prompt = 0
        sampled = {}
        for c in out.chunks:
            req = s.requests[c.request_id]
            if c.num_tokens == 1 and c.start >= req.num_prompt_tokens:
                decodes += 1
                keys += c.start + 1
            else:  # prompt tokens, or a preempted sequence's outputs read again
                again = max(0, c.start + c.num_tokens - req.num_prompt_tokens) - max(0, c.start - req.num_prompt_tokens)
                recomputed += again
                prompt += c.num_tokens - (again if keep_preempted else 0)
            if c.sample:
                sampled[c.request_id] = 1
        ms += cost["fixed"] + cost["per_seq"] * decodes + cost["per_key"] * keys + cost["per_prompt"] * prompt
        s.update(out, sampled)
        out_tokens += len(sampled)
        steps += 1
    return {"output_tok_s": out_tokens / (ms / 1e3), "s": ms / 1e3, "steps": steps,
            "preemptions": s.num_preemptions_total, "recomputed_tokens": recomputed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[512, 3000])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[512])
    ap.add_argument("--blocks", type=int, default=63424, help="the pool (trt-8b-* on an H100: 63,424 of 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--keep-preempted", action="store_true")
    ap.add_argument("--fixed-ms", type=float, default=6.0)
    ap.add_argument("--per-seq-ms", type=float, default=0.0125)
    ap.add_argument("--per-key-ms", type=float, default=2.37e-5)
    ap.add_argument("--per-prompt-ms", type=float, default=0.0194)
    args = ap.parse_args()
    cost = {"fixed": args.fixed_ms, "per_seq": args.per_seq_ms, "per_key": args.per_key_ms,
            "per_prompt": args.per_prompt_ms}
    for n in args.requests:
        for cap in args.max_num_seqs:
            for keep in sorted({False, args.keep_preempted}):
                r = replay(n, args.input_len, args.output_len, cap, args.blocks, args.block_size,
                           args.max_num_batched_tokens, cost, keep)
                print(f"{n:5d} requests, cap {cap:4d}{', preempted kept' if keep else '':17s}: "
                      f"{r['output_tok_s']:9,.0f} output tok/s (model)  {r['s']:7.1f} s  {r['steps']:6d} steps  "
                      f"{r['preemptions']:5d} preemptions  {r['recomputed_tokens']:7d} tokens recomputed")


if __name__ == "__main__":
    main()
