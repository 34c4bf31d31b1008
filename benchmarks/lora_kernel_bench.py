"""The LoRA kernels alone (CUDA): what they add to one decoder layer's linear products, and
which launch settings add least.

One Llama-2-7B layer's four linear layers (qkv, o, gate_up, down; rank-16 adapters on all,
4 slots), captured in a CUDA graph as a decode step replays them: the base products alone,
then with each layer's shrink + expand. Steps: 256 decode rows all on one adapter (the
lora1 workload), 256 rows over four adapters, 64 rows on one, 768 rows on one (256 decodes
beside a 512-token chunk of a prompt: the engine's mixed steps) and an 8,192-row prefill
chunk on one. Swept: token rows per tile (DECODE_BLOCK_M up to 256 rows, PREFILL_BLOCK_M
past), the most K slices of the shrink (SHRINK_MAX_SPLIT_K, SHRINK_PREFILL_SPLIT_K), output columns
and tiles per expand program (EXPAND_BLOCK_N, EXPAND_MAX_GROUP); pagedllm/model_executor/lora.
Each setting's delta is first checked against lora_delta_torch in float32. Prints
microseconds per layer and the share the LoRA kernels add to the base products (the
defaults are marked), then, at the defaults, what the shrinks alone add and what the
expands add on top of them.

    python benchmarks/lora_kernel_bench.py [--json F]
    TRITON_INTERPRET=1 python benchmarks/lora_kernel_bench.py --tiny   # CPU check of the script
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
import torch

from pagedllm.model_executor.lora import layers as lora_layers
from pagedllm.model_executor.lora import triton_ops
from pagedllm.model_executor.lora.layers import LoRABatch, lora_delta_torch

# name: (in features, out features, shards sharing one fused layer)
LINEARS = {"qkv": (4096, 12288, 3), "o": (4096, 4096, 1), "gate_up": (4096, 22016, 2),
           "down": (11008, 4096, 1)}
RANK, SLOTS = 16, 4
STEPS = {"decode256-1adapter": (256, 1), "decode256-4adapters": (256, 4),
         "decode64-1adapter": (64, 1), "mixed768-1adapter": (768, 1), "prefill8192-1adapter": (8192, 1)}
DECODE_SETTINGS = list(itertools.product((16, 32), (8, 16), (64, 128), (1, 4, 8)))
# Steps over 256 rows (a prompt's chunk beside 256 decodes, a prefill chunk): token rows per
# tile, K slices of the shrink, output columns and tiles per expand program.
PREFILL_SETTINGS = list(itertools.product((16, 64), (1, 4, 16), (128,), (1, 4)))


def graph_time(fn, replays: int = 100) -> float:
    """Microseconds per replay of fn captured in a CUDA graph (on the CPU, --tiny: per call)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="shapes / 64 and few settings, float32 "
                    "on the CPU under TRITON_INTERPRET=1: checks the script, times nothing useful")
    args = ap.parse_args()
    global LINEARS, STEPS, DECODE_SETTINGS, PREFILL_SETTINGS
    if args.tiny:
        LINEARS = {name: (k // 64, n // 64, s) for name, (k, n, s) in LINEARS.items()}
        STEPS = {"decode16-1adapter": (16, 1), "decode24-4adapters": (24, 4), "prefill300-1adapter": (300, 1)}
        DECODE_SETTINGS = [(16, 16, 128, 4), (32, 4, 64, 1)]
        PREFILL_SETTINGS = [(64, 1, 128, 4), (16, 4, 64, 1)]
    cuda = torch.cuda.is_available()
    dev, dt = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    weights, lora = {}, {}
    for name, (k, n, shards) in LINEARS.items():
        weights[name] = torch.randn(n, k, generator=g, device=dev, dtype=dt) / k**0.5
        r = shards * RANK
        lora[name] = (torch.randn(SLOTS, r, k, generator=g, device=dev, dtype=dt) / k**0.5,
                      torch.randn(SLOTS, n, r, generator=g, device=dev, dtype=dt) / r**0.5)
    knobs = ((lora_layers, "DECODE_BLOCK_M"), (triton_ops, "SHRINK_MAX_SPLIT_K"),
             (triton_ops, "EXPAND_BLOCK_N"), (triton_ops, "EXPAND_MAX_GROUP"))
    prefill_knobs = ((lora_layers, "PREFILL_BLOCK_M"), (triton_ops, "SHRINK_PREFILL_SPLIT_K"),
                     (triton_ops, "EXPAND_BLOCK_N"), (triton_ops, "EXPAND_MAX_GROUP"))
    defaults = tuple(getattr(mod, name) for mod, name in knobs)
    prefill_defaults = tuple(getattr(mod, name) for mod, name in prefill_knobs)
    rows = []
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"LoRA kernels on one Llama-2-7B layer, rank {RANK}, {SLOTS} slots ({device_name})")
    print(f"{'step':22s} {'BM':>3s} {'splitK':>6s} {'BN':>4s} {'group':>5s} {'base us':>8s} "
          f"{'+LoRA us':>9s} {'added':>7s} {'err':>8s}")
    for step, (m, adapters) in STEPS.items():
        xs = {name: torch.randn(m, k, generator=g, device=dev, dtype=dt) for name, (k, _, _) in LINEARS.items()}
        ys = {name: torch.empty(m, n, device=dev, dtype=dt) for name, (_, n, _) in LINEARS.items()}
        slots = (np.arange(m) % adapters).astype(np.int32)
        batch = LoRABatch(SLOTS, m, dev)

        def base(xs=xs, ys=ys) -> None:
            for name in LINEARS:
                torch.matmul(xs[name], weights[name].t(), out=ys[name])

        def with_lora(xs=xs, ys=ys, batch=batch, base=base) -> None:
            base()
            for name in LINEARS:
                a, b = lora[name]
                triton_ops.lora_expand(triton_ops.lora_shrink(xs[name], a, batch), b, ys[name], batch)

        def shrinks_only(xs=xs, batch=batch, base=base) -> None:
            base()
            for name in LINEARS:
                triton_ops.lora_shrink(xs[name], lora[name][0], batch)

        base_us = graph_time(base)
        settings, setting_knobs, step_defaults = ((DECODE_SETTINGS, knobs, defaults) if m <= 256
                                                  else (PREFILL_SETTINGS, prefill_knobs, prefill_defaults))
        if step_defaults not in settings:
            settings = [step_defaults, *settings]
        for setting in settings:
            bm, split, bn, group = setting
            for (mod, name), value in zip(setting_knobs, setting, strict=True):
                setattr(mod, name, value)
            batch.set(slots, m)
            if cuda:
                torch.cuda.synchronize()
            err = 0.0
            for name in LINEARS:  # the kernels' delta against the torch path, in float32
                a, b = lora[name]
                got = torch.zeros_like(ys[name])
                triton_ops.lora_expand(triton_ops.lora_shrink(xs[name], a, batch), b, got, batch)
                want = lora_delta_torch(xs[name].float(), a.float(), b.float(), batch.token_slot)
                err = max(err, ((got.float() - want).norm() / want.norm()).item())
            if err > 2e-2:
                raise AssertionError(f"{step} {setting}: relative error {err:.1e}")
            lora_us = graph_time(with_lora)
            default = setting == step_defaults
            row = {"step": step, "rows": m, "adapters": adapters, "block_m": bm,
                   "shrink_max_split_k": split, "expand_block_n": bn, "expand_max_group": group,
                   "base_us": round(base_us, 2), "with_lora_us": round(lora_us, 2),
                   "added": round((lora_us - base_us) / base_us, 4), "rel_err": err, "default": default}
            if default:  # the shrinks' share of what LoRA adds (the expands: the rest)
                row["shrinks_us"] = round(graph_time(shrinks_only) - base_us, 2)
                row["expands_us"] = round(lora_us - base_us - row["shrinks_us"], 2)
            print(f"{step:22s} {bm:3d} {split:6d} {bn:4d} {group:5d} {base_us:8.1f} {lora_us:9.1f} "
                  f"{(lora_us - base_us) / base_us:7.1%} {err:8.1e}{' *' if default else ''}")
            rows.append(row)
        for (mod, name), value in zip(setting_knobs, step_defaults, strict=True):
            setattr(mod, name, value)
    for step in STEPS:
        mine = [r for r in rows if r["step"] == step]
        best, default = min(mine, key=lambda r: r["with_lora_us"]), next(r for r in mine if r["default"])
        print(f"{step}: default adds {default['added']:.1%} (shrinks {default['shrinks_us']} us, expands "
              f"{default['expands_us']} us a layer), best (BM {best['block_m']}, split "
              f"{best['shrink_max_split_k']}, BN {best['expand_block_n']}, group "
              f"{best['expand_max_group']}) adds {best['added']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "lora_kernels", "device": device_name,
                       "shape": "Llama-2-7B layer", "rank": RANK, "slots": SLOTS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
