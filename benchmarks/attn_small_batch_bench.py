"""Decode attention at small batch and short context (CUDA): where a batch-1 step's
attention time goes, per key-split setting.

At batch 1 a decode's attention reads a few hundred keys per KV head, microseconds of
memory, yet on an H200 (Qwen3-30B-A3B shape, 128 in / 256 out) the kernel took about
9.5 us a layer: latency, not bandwidth. This times one layer's attention (the KV write
and the attention launch, as a step runs them) replayed from a CUDA graph of 48 layers,
for the settings that decide how many programs share a context's keys: SPLIT_MIN_KEYS
(the fewest keys a split reads), the key block (BLOCK_N) and splits off altogether.
Every setting is checked against the torch reference first.

    python benchmarks/attn_small_batch_bench.py [--batch 1 4] [--ctx 128 384 1024 4096] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import torch

from pagedllm.attention import triton_backend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.attention.triton_backend import TritonPagedAttention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_decode import cuda_time  # noqa: E402

DEV = "cuda"
DTYPE = torch.bfloat16  # float32 in Triton's interpreter (its bfloat16 dots are wrong)
SHAPES = {"qwen3-moe": (32, 4, 128), "llama3-8b": (32, 8, 128)}
PAGE = 16
LAYERS = 48
# (name, SPLIT_MIN_KEYS, MAX_KV_SPLITS, BLOCK_N)
SETTINGS = [("current", 256, 16, 64), ("min128", 128, 16, 64), ("min64", 64, 16, 64),
            ("min64-n32", 64, 16, 32), ("unsplit", 256, 1, 64)]


def build(hq: int, hkv: int, dim: int, batch: int, ctx: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    nblk = -(-ctx // PAGE)
    num_blocks = batch * nblk + 1
    kc = torch.randn((num_blocks, PAGE, hkv, dim), generator=g, device=DEV).to(DTYPE)
    vc = torch.randn((num_blocks, PAGE, hkv, dim), generator=g, device=DEV).to(DTYPE)
    perm = torch.randperm(num_blocks - 1, generator=g, device=DEV)[: batch * nblk] + 1
    tables = perm.view(batch, nblk).to(torch.int32)
    q = torch.randn((batch, hq, dim), generator=g, device=DEV).to(DTYPE)
    k = torch.randn((batch, hkv, dim), generator=g, device=DEV).to(DTYPE)
    v = torch.randn((batch, hkv, dim), generator=g, device=DEV).to(DTYPE)
    last = (ctx - 1) // PAGE
    slots = (tables[:, last].long() * PAGE + (ctx - 1) % PAGE)
    ar = torch.arange(batch, dtype=torch.int32, device=DEV)
    ql = torch.ones(batch, dtype=torch.int32, device=DEV)
    cl = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    # the reference loops over sequences by host lengths; the kernels get none (a graph's layout)
    ref_meta = AttentionMetadata(slot_mapping=slots, num_decode=batch, block_tables=tables, q_start=ar,
                                 q_len=ql, ctx_len=cl, host_q_start=ar.cpu().numpy(), host_q_len=ql.cpu().numpy(),
                                 host_ctx_len=cl.cpu().numpy(), host_block_tables=tables.cpu().numpy())
    meta = dataclasses.replace(ref_meta, host_q_start=None, host_q_len=None, host_ctx_len=None,
                               host_block_tables=None)
    return q, k, v, kc, vc, meta, ref_meta


def layer_us(fn) -> float:
    """One call's device time inside a CUDA graph of LAYERS calls, replayed 20 times."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAYERS):
            fn()
    return cuda_time(g.replay, 20) * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128, 384, 1024, 4096])
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-only", action="store_true", help="the reference checks alone (any device)")
    args = ap.parse_args()
    rows = []
    saved = (triton_backend.SPLIT_MIN_KEYS, triton_backend.MAX_KV_SPLITS, dict(TritonPagedAttention.DECODE_LAUNCH))
    for shape, (hq, hkv, dim) in SHAPES.items():
        for batch in args.batch:
            for ctx in args.ctx:
                q, k, v, kc, vc, meta, ref_meta = build(hq, hkv, dim, batch, ctx)
                ref = TorchPagedAttention.forward(q.float(), k.float(), v.float(), kc.float(), vc.float(),
                                                  ref_meta, dim**-0.5)
                row = {"shape": shape, "batch": batch, "ctx": ctx}
                for name, min_keys, max_splits, block_n in SETTINGS:
                    triton_backend.SPLIT_MIN_KEYS, triton_backend.MAX_KV_SPLITS = min_keys, max_splits
                    TritonPagedAttention.DECODE_LAUNCH = dict(saved[2], BLOCK_N=block_n)
                    out = TritonPagedAttention.forward(q, k, v, kc, vc, meta, dim**-0.5)
                    err = (out.float() - ref).abs().max().item()
                    if err > 3e-2:
                        raise SystemExit(f"{shape} b{batch} ctx{ctx} {name}: max error {err}")
                    if args.check_only:
                        row[name] = f"ok ({err:.1e})"
                        continue
                    call = functools.partial(TritonPagedAttention.forward, q, k, v, kc, vc, meta, dim**-0.5)
                    row[name] = round(layer_us(call), 2)
                triton_backend.SPLIT_MIN_KEYS, triton_backend.MAX_KV_SPLITS = saved[0], saved[1]
                TritonPagedAttention.DECODE_LAUNCH = dict(saved[2])
                rows.append(row)
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "layers_per_graph": LAYERS,
                       "settings": SETTINGS, "rows_us_per_layer": rows}, f, indent=1)


if __name__ == "__main__":
    if not torch.cuda.is_available():  # --check-only in Triton's interpreter
        DEV, DTYPE = "cpu", torch.float32
    main()
