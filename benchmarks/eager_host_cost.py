"""What an eager decode step costs the host, piece by piece (CUDA only).

`--enforce-eager` runs every kernel launch from Python each step; with CUDA graphs one
replay does the lot. Where the eager step is host-bound, its time is the sum of what the
pieces below cost the host, not the GPU. Each piece is measured while the GPU is held busy
by `torch.cuda._sleep`, so the launches queue up and the wall time of N calls is their host
cost alone (N is kept small enough that the launch queue never fills).

Prints microseconds a call for: a bare Triton launch (few / many arguments), torch ops, the
model's norms, linears, the attention backend's decode, the MoE block's routing, pair
alignment and expert kernels, a whole decoder layer; then the engine's eager and
CUDA-graph decode steps at the same batch for comparison.

    python benchmarks/eager_host_cost.py --workload gpu-moe --layers 8 --batch 64
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.bench_workloads import WORKLOADS, random_dataset, write_arch_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run of the script
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _noop1(X):
        pass

    @triton.jit
    def _noop24(A, B, C, D, E, F, G, H, n0, n1, n2, n3, n4, n5, n6, n7, s0, s1, s2, s3, s4, s5,
                P: tl.constexpr, Q: tl.constexpr):
        pass
except ImportError:  # pragma: no cover
    triton = None


def host_us(fn, calls: int = 40, spin_ms: float = 50.0) -> float:
    """Host microseconds a call of `fn`, the GPU kept busy so that nothing waits on it."""
    cuda = torch.cuda.is_available()
    fn()
    if cuda:
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        if cuda:
            torch.cuda._sleep(int(spin_ms * 1.4e6))  # ~spin_ms at ~1.4-1.9 GHz
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return best


def device_name() -> str:
    return torch.cuda.get_device_name() if DEV == "cuda" else "cpu"


def decode_metadata(runner, batch: int, ctx: int):
    from pagedllm.attention.metadata import AttentionMetadata

    bs = runner.block_size
    nblk = -(-ctx // bs)
    num_blocks = runner.kv_caches[0][0].shape[0]
    tables = (torch.arange(batch * nblk, device=DEV, dtype=torch.int32) % num_blocks).view(batch, nblk)
    return AttentionMetadata(  # each row writes its K/V to its own slot of block 0..
        slot_mapping=torch.arange(batch, device=DEV, dtype=torch.int64), num_decode=batch,
        block_tables=tables, q_start=torch.arange(batch, device=DEV, dtype=torch.int32),
        q_len=torch.ones(batch, device=DEV, dtype=torch.int32),
        ctx_len=torch.full((batch,), ctx, device=DEV, dtype=torch.int32),
        host_q_start=np.arange(batch, dtype=np.int32), host_q_len=np.ones(batch, np.int32),
        host_ctx_len=np.full(batch, ctx, np.int32))


def make_engine(path: str, args, eager: bool) -> LLM:
    """An engine on the workload's shape, on args.gpu_memory_utilization of the GPU (a
    quarter by default; the whole gpu-moe model, 61 GB of weights at 48 layers, needs most
    of the card); each is shut down before the next is built."""
    return LLM(model=path, load_format="dummy", dtype=str(DTYPE).removeprefix("torch."),
               skip_tokenizer_init=True, device=DEV, enforce_eager=eager, max_num_seqs=args.batch,
               gpu_memory_utilization=args.gpu_memory_utilization)


def engine_ms_per_step(path: str, args, eager: bool) -> float:
    batch, out_len = args.batch, args.out_len
    llm = make_engine(path, args, eager)
    vocab = llm.engine.executor.vocab_size
    data = random_dataset(batch, (128, 128), (out_len, out_len), vocab, 0)
    prompts = [{"prompt_token_ids": p} for p in data.prompts]
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=1.0)
    llm.generate(prompts, params, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    llm.engine.shutdown()
    del llm
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return wall / out_len * 1e3  # one prefill step amortised over the decode steps


def layer_pieces(path: str, args) -> dict[str, float]:
    """Host microseconds of the first decoder layer's pieces, one eager engine's model."""
    rows: dict[str, float] = {}
    llm = make_engine(path, args, eager=True)
    runner = llm.engine.executor.runner
    model = runner.model
    layer = model.model.layers[0]
    s = model.shape
    with torch.inference_mode():
        x = torch.randn(args.batch, s.hidden, device=DEV, dtype=DTYPE)
        res = torch.randn_like(x)
        positions = torch.full((args.batch,), args.ctx - 1, device=DEV, dtype=torch.int64)
        meta = decode_metadata(runner, args.batch, args.ctx)
        cache = runner.kv_caches[0]
        attn = layer.self_attn
        rows["rmsnorm + residual"] = host_us(lambda: layer.input_layernorm(x, res))
        rows["qkv linear"] = host_us(lambda: attn.qkv_proj(x))
        rows["attention module (qkv .. o_proj)"] = host_us(lambda: attn(positions, x, cache, meta))
        q = torch.randn(args.batch, s.num_heads, s.head_dim, device=DEV, dtype=DTYPE)
        k = torch.randn(args.batch, s.num_kv_heads, s.head_dim, device=DEV, dtype=DTYPE)
        rows["rotary"] = host_us(lambda: attn.rotary(positions, q, k))
        rows["attention backend decode"] = host_us(
            lambda: attn.backend.forward(q, k, k, cache[0], cache[1], meta, attn.scale))
        mlp = layer.mlp
        rows["mlp module"] = host_us(lambda: mlp(x))
        if hasattr(mlp, "route"):
            from pagedllm.model_executor.layers import fused_moe

            weights, ids = mlp.route(x)
            rows["moe gate linear"] = host_us(lambda: mlp.gate(x))
            rows["moe route (gate + kernel)"] = host_us(lambda: mlp.route(x))
            cfg = fused_moe.pick_config(ids.numel(), mlp.num_experts, s.hidden, mlp.inter, mlp.top_k)
            rows["moe align_pairs"] = host_us(lambda: fused_moe.align_pairs(ids, mlp.num_experts, cfg["BM"]))
            rows["moe pick_config"] = host_us(lambda: fused_moe.pick_config(
                ids.numel(), mlp.num_experts, s.hidden, mlp.inter, mlp.top_k))
            rows["moe run_experts"] = host_us(lambda: mlp.run_experts(x, weights, ids))
        rows["decoder layer"] = host_us(lambda: layer(positions, x, res, cache, meta), calls=20)
    llm.engine.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="gpu-moe")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=384)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                    help="of the GPU each engine takes (0.9 for the 48-layer gpu-moe model)")
    ap.add_argument("--tiny", action="store_true", help="a small config (CPU smoke run)")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    config = dict(w.arch_config, num_hidden_layers=args.layers)
    if args.tiny:  # the CPU smoke run
        config.update(vocab_size=1024, hidden_size=256, moe_intermediate_size=64, num_experts=16,
                      intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    path = write_arch_config(config)
    rows: dict[str, float] = {}

    x1 = torch.empty(1, device=DEV)
    if triton is not None and DEV == "cuda":
        rows["triton launch, 1 arg"] = host_us(lambda: _noop1[(1,)](x1))
        t8 = [torch.empty(16, device=DEV) for _ in range(8)]
        rows["triton launch, 24 args"] = host_us(
            lambda: _noop24[(64,)](*t8, *range(8), *range(6), P=16, Q=64))
    a = torch.randn(args.batch, 2048, device=DEV, dtype=DTYPE)
    rows["torch add"] = host_us(lambda: a + a)
    rows["torch.empty"] = host_us(lambda: torch.empty(args.batch, 2048, device=DEV))

    rows.update(layer_pieces(path, args))
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()

    steps = {}
    for eager in (True, False):
        steps["eager" if eager else "graphs"] = engine_ms_per_step(path, args, eager)

    print(f"\n== host cost per call, {args.workload} shape, batch {args.batch} ({device_name()})")
    for name, us in rows.items():
        print(f"{name:40s} {us:8.1f} us")
    print(f"\n{args.layers} layers, batch {args.batch}: eager {steps['eager']:.2f} ms/step, "
          f"CUDA graphs {steps['graphs']:.2f} ms/step, ratio {steps['eager'] / steps['graphs']:.2f}")
    print(f"decoder layer host x {args.layers} = {rows['decoder layer'] * args.layers / 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "eager_host_cost", "device": device_name(),
                       "workload": args.workload, "layers": args.layers, "batch": args.batch,
                       "host_us": rows, "ms_per_step": steps}, f, indent=1)


if __name__ == "__main__":
    main()
