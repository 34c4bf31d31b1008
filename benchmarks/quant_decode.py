"""bf16 vs W4A16 (GPTQ-layout 4-bit, Triton kernel) on Llama-2-7B shapes.

Two measurements:
- `layers`: the 32 decoder layers' linear stack (qkv 4096->12288, o 4096->4096,
  gate_up 4096->22016, down 11008->4096) at batch 1/16/256, each stack captured in one CUDA
  graph so launch gaps do not hide the kernels' time. Decode is bound by reading weights,
  so bytes/time is printed next to the copy bandwidth of the card.
- `engine`: the whole model through `LLM(load_format="dummy", quantization=...)`: time per
  decode step of the real engine (Python scheduler and all, decode CUDA graphs), bf16 and
  GPTQ loaded together and measured in turns, the median of --repeats.

Usage:  python benchmarks/quant_decode.py [--mode layers|engine|both] [--batch 1 16 256]
        [--layers 32] [--group-size 128] [--sweep [--sweep-best]] [--repeats 5]
Prints a table; writes the numbers to $OUT/quant_decode.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagedllm.model_executor.layers.linear import LinearBase, ReplicatedLinear  # noqa: E402
from pagedllm.model_executor.layers.quantization import QuantConfig  # noqa: E402

HIDDEN, INTER, VOCAB = 4096, 11008, 32000
# (name, in_features, out_features) of one Llama-2-7B decoder layer's fused linears
LAYER = (("qkv", HIDDEN, 3 * HIDDEN), ("o", HIDDEN, HIDDEN), ("gate_up", HIDDEN, 2 * INTER),
         ("down", INTER, HIDDEN))


def _median_ms(fn, iters: int) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end, strict=True))
    return times[len(times) // 2]


def _stack_one(k: int, n: int, quant: QuantConfig, dtype: torch.dtype, g: torch.Generator):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            m = ReplicatedLinear(k, n, False, quant)
    finally:
        torch.set_default_dtype(prev)
    m.fill_random(g)
    m.finish_loading()
    return (m.requires_grad_(False),)


def _stack(kind: str, layers: int, quant: QuantConfig, dtype: torch.dtype, device: str):
    """One linear module per (layer, name): nn.Linear in `dtype`, or a packed linear layer."""
    g = torch.Generator().manual_seed(0)
    mods = []
    for _ in range(layers):
        for _, k, n in LAYER:
            if kind == "bf16":
                m = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
                torch.nn.init.normal_(m.weight, std=0.02)
                mods.append(m.requires_grad_(False))
            else:
                mods += _stack_one(k, n, quant, dtype, g)
    return mods


def _weight_bytes(mods) -> int:
    return sum(p.numel() * p.element_size() for m in mods for p in m.parameters())


def _run_stack(mods, x_h, x_i):
    """Every linear of every layer once, feeding each its right-sized input."""
    out = None
    for i, m in enumerate(mods):
        out = m(x_i if i % 4 == 3 else x_h)
    return out


def copy_bandwidth_gbs(device: str) -> float:
    a = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = _median_ms(lambda: b.copy_(a), 10)
    return 2 * a.numel() * 2 / ms / 1e6


def bench_layers(args, quant: QuantConfig, dtype: torch.dtype) -> list[dict]:
    device = "cuda"
    rows = []
    stacks = {kind: _stack(kind, args.layers, quant, dtype, device) for kind in ("bf16", "w4a16")}
    for batch in args.batch:
        x_h = torch.randn(batch, HIDDEN, device=device, dtype=dtype)
        x_i = torch.randn(batch, INTER, device=device, dtype=dtype)
        row = {"batch": batch, "layers": args.layers}
        with torch.inference_mode():
            for kind, mods in stacks.items():
                _run_stack(mods, x_h, x_i)  # compile / pick kernels outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    _run_stack(mods, x_h, x_i)
                for _ in range(3):
                    graph.replay()
                ms = _median_ms(graph.replay, args.iters)
                nbytes = _weight_bytes(mods)
                flops = 2 * batch * sum(k * n for _, k, n in LAYER) * args.layers
                row[f"{kind}_ms"] = round(ms, 4)
                row[f"{kind}_weight_GB"] = round(nbytes / 1e9, 3)
                row[f"{kind}_GBps"] = round(nbytes / ms / 1e6, 1)
                row[f"{kind}_TFLOPs"] = round(flops / ms / 1e9, 1)
                del graph
        row["speedup"] = round(row["bf16_ms"] / row["w4a16_ms"], 2)
        rows.append(row)
    return rows


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _candidates(batch: int, n: int, k: int, sms: int) -> list[dict]:
    """Tile shapes (each one compile) times K splits (runtime arguments: free), and the
    dequantize + cuBLAS path at a few chunk sizes."""
    from pagedllm.model_executor.layers.quantization.triton_w4a16 import SCRATCH_ELEMENTS

    if batch == 1:  # (gemv, BLOCK_M, BLOCK_N, warps, stages); also the tensor-core kernel, rows masked
        cfgs = [(True, 1, bn, w, 3) for bn, w in ((32, 1), (64, 2), (64, 4), (128, 2), (128, 4), (256, 4))]
        cfgs += [(False, 16, bn, w, st) for bn, w, st in ((64, 2, 2), (64, 2, 3), (64, 4, 3), (128, 4, 3))]
    elif batch <= 16:
        cfgs = [(False, 16, bn, w, st) for bn, w in ((32, 1), (64, 1), (64, 2), (64, 4), (128, 2), (128, 4),
                                                     (256, 4)) for st in (2, 3, 4)]
    elif batch <= 64:
        cfgs = [(False, bm, bn, 4, st) for bm in (32, 64) for bn in (64, 128) for st in (2, 3)]
    else:
        cfgs = [(False, bm, bn, w, 3) for bm, bn, w in ((64, 128, 4), (128, 128, 8), (128, 256, 8), (64, 256, 8))]
    # ways to the weights of the tensor-core kernel: 16-bit floats from the bits (magic; in
    # one accumulator or two; the scale folded into them or on each tile's partial), float32
    # with the zero point in a second product, float32 q - z
    unpacks = [dict(magic=True, two_acc=False), dict(magic=True, two_acc=True),
               dict(magic=True, two_acc=False, fold=True), dict(magic=True, two_acc=True, fold=True),
               dict(magic=False, zero_in_dot=True), dict(magic=False, zero_in_dot=False)]
    out = []
    for gemv, bm, bn, warps, stages in cfgs:
        for target in (1, 2, 4, 8, 16):
            tiles = _cdiv(batch, bm) * _cdiv(n, bn)
            split = max(1, min(_cdiv(target * sms, tiles), k // 256))
            kps = _cdiv(_cdiv(k, split), 128) * 128
            for unpack in [{}] if gemv else unpacks if batch > 16 else unpacks[:4]:
                cfg = dict(gemv=gemv, planes=not gemv, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                           num_stages=stages, split=_cdiv(k, kps), k_per_split=kps, **unpack)
                if cfg not in out:
                    out.append(cfg)
    if batch >= 16:
        out += [dict(gemv=False, planes=False, dequant=True, chunk_elements=SCRATCH_ELEMENTS // d) for d in (1, 2, 4)]
    if batch <= 8:  # the Hopper kernel (mma_w4a16): columns a program, warps (K splits), row sums
        out += [dict(mma=True, mma_config=(bn, w, rs)) for bn in (16, 32, 64) for w in (1, 2, 4, 8)
                for rs in (False, True) if bn * w <= 256]
    return out


def _time_config(x, mods: list[LinearBase], cfg: dict | None, ref: torch.Tensor) -> float | None:
    """GPU time of one call: a CUDA graph of one call per copy of the layer (so the
    weights come from memory, not the 60 MB L2, and Python's launch cost is left out).
    The configuration must first reproduce `ref`, mods[0]'s float32 product with x."""
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    def call(m: LinearBase) -> torch.Tensor:
        return tw.wna16_matmul(x, m.qweight, m.scales, m.qzeros, None, m.method.group_size, 4, m.quant.zero_offset,
                               cfg)

    def run_all():
        for m in mods:
            call(m)

    try:
        err = ((call(mods[0]).float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            raise ValueError(f"relative error {err:.2e}")
        run_all()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
    except Exception as e:  # noqa: BLE001 - a config that does not compile (or is wrong) is skipped
        print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
        return None
    graph.replay()
    return _median_ms(graph.replay, 10) / len(mods)


def sweep(args, quant: QuantConfig, dtype: torch.dtype) -> list[dict]:
    """Time a few kernel configurations per (shape, batch) against the built-in choice."""
    g = torch.Generator().manual_seed(0)
    out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, k, n in LAYER:
        mods = [_stack_one(k, n, quant, dtype, g)[0] for _ in range(max(2, 256 * 2**20 // (k * n // 2)))]
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        for batch in args.batch:
            x = torch.randn(batch, k, device="cuda", dtype=dtype)
            ref = x.float() @ mods[0].dequantized_weight(torch.float32).t()  # once for every candidate
            default_ms = _time_config(x, mods, None, ref)
            results = [(ms, c) for c in _candidates(batch, n, k, sms)
                       if (ms := _time_config(x, mods, c, ref)) is not None]
            best_ms, best = min(results, key=lambda r: r[0])
            family = {}  # the best of each kernel (and of each way to the weights)
            for ms, c in results:
                name_c = "mma" if c.get("mma") else "dequant" if c.get("dequant") else "gemv" if c.get("gemv") else (
                    ("planes-magic" + ("-fold" if c.get("fold") else "") + ("-two-acc" if c.get("two_acc") else ""))
                    if c.get("magic") else "planes-f32")
                if name_c not in family or ms < family[name_c][0]:
                    family[name_c] = (ms, c)
            torch.nn.functional.linear(x, w)  # cuBLAS initialises outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    torch.nn.functional.linear(x, w)
            bf16_ms = _median_ms(graph.replay, 10) / 10
            out.append({"linear": name, "k": k, "n": n, "batch": batch, "bf16_ms": round(bf16_ms, 4),
                        "default_ms": round(default_ms, 4), "best_ms": round(best_ms, 4), "best": best,
                        "by_kernel": {f: {"ms": round(ms, 4), "config": c} for f, (ms, c) in family.items()}})
            print(f"{name:>8} M={batch:<4} bf16 {bf16_ms * 1e3:8.1f} us  default {default_ms * 1e3:8.1f} us"
                  f"  best {best_ms * 1e3:8.1f} us {best}")
            for f, (ms, c) in family.items():
                print(f"{'':>8} {f:>8} {ms * 1e3:8.1f} us {c}")
    return out


LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
             "intermediate_size": INTER, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": VOCAB, "max_position_embeddings": 4096,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float16",
             "tie_word_embeddings": False}


def _step_timer(llm, batch: int, steps: int):
    """A function giving (time of prefill + `steps` decodes) - (time of prefill alone), per
    decode step, in ms; the kernels are compiled and the graphs captured first."""
    from pagedllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % VOCAB for j in range(16)]} for i in range(batch)]

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    return lambda: (run(steps + 1) - run(1)) / steps * 1e3


def bench_engine(args) -> list[dict]:
    """Both models loaded at once and measured in turns, `repeats` times per batch: one
    difference of two runs moved by 0.1-0.3 ms per step between runs of the same build,
    and in turns a drift of the clocks weighs on both alike. The median is reported."""
    from pagedllm import LLM

    rows = []
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**LLAMA2_7B, "num_hidden_layers": args.layers}, f)
        llms = {quant or "bf16": LLM(model=d, load_format="dummy", quantization=quant, dtype="bfloat16",
                                     skip_tokenizer_init=True, max_model_len=1024, num_kv_blocks=2048,
                                     max_num_seqs=max(args.batch))
                for quant in (None, "gptq")}
        for batch in args.batch:
            timers = {name: _step_timer(llm, batch, args.decode_steps) for name, llm in llms.items()}
            times: dict[str, list[float]] = {name: [] for name in llms}
            for _ in range(args.repeats):
                for name, timer in timers.items():
                    times[name].append(timer())
            for name, llm in llms.items():
                ms = sorted(times[name])[len(times[name]) // 2]
                rows.append({"quantization": name, "batch": batch, "layers": args.layers,
                             "weights_GiB": llm.engine.describe()["weights_GiB"],
                             "decode_step_ms": round(ms, 3), "tokens_per_s": round(batch / ms * 1e3, 1),
                             "all_ms": [round(t, 3) for t in times[name]]})
                print(rows[-1])
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["layers", "engine", "both"], default="layers")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="engine: median of this many measurements")
    p.add_argument("--sweep", action="store_true", help="also time alternative kernel configs per shape")
    p.add_argument("--sweep-best", action="store_true", help="time the stack with the sweep's best configs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device (the CPU path dequantizes once and runs float matmuls)")
        return 1
    dtype = torch.bfloat16
    quant = QuantConfig("gptq", 4, args.group_size, "gptq")
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "group_size": args.group_size, "copy_GBps": round(copy_bandwidth_gbs("cuda"), 1)}
    print(f"{result['device']}: device-to-device copy {result['copy_GBps']} GB/s")
    if args.sweep:
        result["sweep"] = sweep(args, quant, dtype)
        if args.sweep_best:  # the stack below runs each shape's fastest configuration
            from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

            best = {(r["batch"], r["n"], r["k"]): r["best"] for r in result["sweep"]}
            table = tw.pick_config
            tw.pick_config = lambda m, n, k, *rest: best.get((m, n, k)) or table(m, n, k, *rest)
            result["layers_configs"] = "the sweep's best per shape"
    if args.mode in ("layers", "both"):
        rows = bench_layers(args, quant, dtype)
        result["layers"] = rows
        print(f"\nLlama-2-7B linear stack, {args.layers} layers, g{args.group_size}, CUDA graph per stack")
        print(f"{'batch':>6} {'bf16 ms':>9} {'w4a16 ms':>9} {'speedup':>8} {'bf16 GB/s':>10} "
              f"{'w4 GB/s':>9} {'bf16 TF/s':>10} {'w4 TF/s':>9}")
        for r in rows:
            print(f"{r['batch']:>6} {r['bf16_ms']:>9.3f} {r['w4a16_ms']:>9.3f} {r['speedup']:>8.2f} "
                  f"{r['bf16_GBps']:>10.0f} {r['w4a16_GBps']:>9.0f} {r['bf16_TFLOPs']:>10.1f} {r['w4a16_TFLOPs']:>9.1f}")
    if args.mode in ("engine", "both"):
        result["engine"] = bench_engine(args)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "quant_decode.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
