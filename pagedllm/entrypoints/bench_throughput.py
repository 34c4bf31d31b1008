"""`pagedllm bench throughput`: offline throughput, the method of `vllm bench throughput`.

All requests are submitted at once with `ignore_eos`, each generates exactly its output
length, and the figure is output tokens per second of wall time for the whole workload.
Model load is excluded; one small untimed warm-up (other random prompts, so the prefix
cache gains nothing from it) runs first. `--backend both` runs the HF transformers
baseline on the same token ids in the same process and reports the ratio, because the
machines are shared and only a same-run ratio is comparable across days.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pagedllm.config import EngineConfig, dtype_name
from pagedllm.entrypoints.bench_report import args_dict, device_name, environment, write_json
from pagedllm.entrypoints.bench_roofline import ceilings, roofline
from pagedllm.entrypoints.bench_workloads import (
    WORKLOADS,
    RandomDataset,
    Workload,
    length_range,
    random_dataset,
    write_arch_config,
)
from pagedllm.model_executor.loader.loader import load_hf_config
from pagedllm.model_source import resolve_source

T = TypeVar("T")

DEFAULT_NUM_PROMPTS = 64
DEFAULT_INPUT_LEN = 256
DEFAULT_OUTPUT_LEN = 128
DEFAULT_HF_BATCH_SIZE = 16


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    """Flags of `bench throughput`. Unset workload flags take the `--workload` preset's value."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a preset workload (model shape, dtype, requests, lengths, HF "
                        "batch size); flags given explicitly override it")
    w.add_argument("--num-prompts", type=int, help=f"requests (default {DEFAULT_NUM_PROMPTS})")
    w.add_argument("--input-len", type=int, help=f"prompt tokens (default {DEFAULT_INPUT_LEN})")
    w.add_argument("--output-len", type=int,
                   help=f"output tokens per request (default {DEFAULT_OUTPUT_LEN})")
    w.add_argument("--range-ratio", type=float,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0)")
    w.add_argument("--seed", type=int, default=0, help="dataset and sampling seed")
    w.add_argument("--temperature", type=float, default=1.0,
                   help="1.0 samples from the full distribution as vllm bench does; 0 = greedy")
    w.add_argument("--warmup", type=int, default=8,
                   help="output tokens of the untimed warm-up requests (0: no warm-up)")
    w.add_argument("--repeats", type=int, default=1,
                   help="timed runs per backend; figures are the median (on CPU the backends' "
                        "runs alternate)")

    m = p.add_argument_group("model")
    m.add_argument("--model", help="HF directory, .gguf file, or (with --load-format dummy) a "
                                   "directory holding config.json; default: SmolLM2-135M GGUF")
    m.add_argument("--load-format", choices=["auto", "safetensors", "pt", "gguf", "dummy"])
    m.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    m.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda when available)")

    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", "--max-context-length", dest="max_model_len", type=int)
    e.add_argument("--max-num-seqs", "--max-concurrent-requests", dest="max_num_seqs", type=int,
                   default=256)
    e.add_argument("--max-num-batched-tokens", "--max-tokens-per-batch",
                   dest="max_num_batched_tokens", type=int)
    e.add_argument("--max-prefill-tokens-with-decodes", type=int,
                   help="prompt tokens a step may read while sequences decode (default: the "
                        "engine's; 0: the whole budget)")
    e.add_argument("--block-size", type=int)
    e.add_argument("--num-kv-blocks", type=int)
    e.add_argument("--kv-cache-memory", help="CPU KV pool, e.g. 4GiB")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="host GiB for preempted sequences' pages (default: the engine's, off)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs (or CPU processes) the model is split over (default 1)")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="overlap scheduling with the device's step (default: on for one CUDA device)")
    e.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: decode steps run eagerly instead of replaying CUDA graphs")
    e.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   help="the engine's batch-invariant mode (what determinism costs)")
    e.add_argument("--quantization", "-q", choices=["fp8"],
                   help="quantize the weights at load (default: the workload's, else none)")
    e.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV page dtype (default: the workload's, else the model's dtype)")
    e.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    e.add_argument("--disable-detokenize", action="store_true",
                   help="skip incremental detokenization (always skipped without a tokenizer)")

    b = p.add_argument_group("backends")
    b.add_argument("--backend", choices=["pagedllm", "hf", "both"], default="pagedllm",
                   help="both: engine and HF baseline in one process, with their ratio")
    b.add_argument("--hf-batch-size", type=int, help="static batch size of the HF baseline")
    b.add_argument("--hf-dtype", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the HF baseline (default: the engine's)")
    b.add_argument("--hf-static-cache", action="store_true",
                   help="HF with cache_implementation='static' (torch.compile'd on CUDA)")
    b.add_argument("--peak-bandwidth", type=float,
                   help="memory bandwidth in TB/s for the roofline (default on CUDA: the "
                        "card's copy bandwidth, measured at the start of the run)")
    b.add_argument("--peak-tflops", type=float,
                   help="matmul TFLOP/s for the roofline (default on CUDA: the card's bf16 "
                        "matmul rate, measured at the start of the run)")
    p.add_argument("--output-json", help="write the result here")


@dataclass
class ThroughputConfig:
    """The arguments with the preset and the defaults applied: what the run really used."""

    workload: str | None
    model: str | None
    load_format: str
    dtype: str
    num_prompts: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    hf_batch_size: int
    quantization: str | None = None
    kv_cache_dtype: str = "auto"


def _given(value: T | None, fallback: T) -> T:
    return fallback if value is None else value


def resolve_config(args: argparse.Namespace) -> ThroughputConfig:
    """Explicit flags win, then the `--workload` preset, then the defaults. `--range-ratio`
    applies to the lengths given by flag (a preset's ranges are already ranges)."""
    ratio = args.range_ratio or 0.0
    base = WORKLOADS[args.workload] if args.workload else Workload(
        "custom", None, "auto", "auto", DEFAULT_NUM_PROMPTS,
        length_range(DEFAULT_INPUT_LEN, ratio), length_range(DEFAULT_OUTPUT_LEN, ratio),
        DEFAULT_HF_BATCH_SIZE, DEFAULT_HF_BATCH_SIZE)
    model = args.model
    if model is None and base.arch_config is not None:
        model = write_arch_config(base.arch_config)
    hf_batch = base.hf_static_batch_size if args.hf_static_cache else base.hf_batch_size
    return ThroughputConfig(
        workload=args.workload,
        model=model,
        load_format=_given(args.load_format, base.load_format),
        dtype=_given(args.dtype, base.dtype),
        num_prompts=_given(args.num_prompts, base.num_prompts),
        input_range=(length_range(args.input_len, ratio) if args.input_len is not None
                     else base.input_range),
        output_range=(length_range(args.output_len, ratio) if args.output_len is not None
                      else base.output_range),
        hf_batch_size=_given(args.hf_batch_size, hf_batch),
        quantization=_given(getattr(args, "quantization", None), base.quantization),
        kv_cache_dtype=_given(getattr(args, "kv_cache_dtype", None), base.kv_cache_dtype),
    )


def figures(elapsed_s: float, data: RandomDataset) -> dict:
    n_in, n_out = data.num_prompt_tokens, data.num_output_tokens
    return {
        "elapsed_s": round(elapsed_s, 4),
        "num_requests": len(data),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "requests_per_s": round(len(data) / elapsed_s, 4),
        "total_tokens_per_s": round((n_in + n_out) / elapsed_s, 2),
        "output_tokens_per_s": round(n_out / elapsed_s, 2),
    }


def _has_tokenizer(cfg: ThroughputConfig) -> bool:
    """Random-weight and tokenizer-less checkpoints run without detokenization."""
    source = resolve_source(cfg.model, cfg.load_format)
    if source.load_format == "dummy":
        return False
    return source.kind == "gguf" or any(
        os.path.exists(os.path.join(source.path, f))
        for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Backend(Protocol):
    """What the timing loop needs of the engine and of the HF baseline alike."""

    name: str

    def warmup(self, data: RandomDataset) -> None: ...

    def run(self, data: RandomDataset) -> float: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...


class EngineBackend:
    """pagedllm through the offline `LLM` API: every request submitted in one `generate`."""

    name = "pagedllm"

    def __init__(self, args: argparse.Namespace, cfg: ThroughputConfig):
        from pagedllm import LLM

        kwargs: dict = {
            "load_format": cfg.load_format, "dtype": cfg.dtype, "seed": args.seed,
            "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "num_kv_blocks": args.num_kv_blocks,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "enable_prefix_caching": args.enable_prefix_caching, "device": args.device,
            "async_scheduling": args.async_scheduling,
            "batch_invariant": args.batch_invariant,
            "enforce_eager": bool(args.enforce_eager),
            "tensor_parallel_size": args.tensor_parallel_size,
            "skip_tokenizer_init": args.disable_detokenize or not _has_tokenizer(cfg),
        }
        if getattr(args, "speculative_config", None):
            kwargs["speculative_config"] = args.speculative_config
        if cfg.quantization is not None:
            kwargs["quantization"] = cfg.quantization
        if cfg.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = cfg.kv_cache_dtype
        if getattr(args, "max_prefill_tokens_with_decodes", None) is not None:
            kwargs["max_prefill_tokens_with_decodes"] = args.max_prefill_tokens_with_decodes
        if args.block_size is not None:  # otherwise the engine's default
            kwargs["block_size"] = args.block_size
        if args.kv_cache_memory is not None:
            kwargs["kv_cache_memory"] = args.kv_cache_memory
        if getattr(args, "swap_space", None):
            kwargs["swap_space"] = args.swap_space
        self.llm = LLM(model=cfg.model, **kwargs)
        self.temperature = args.temperature
        self.device = self.llm.engine.executor.device

    def _generate(self, data: RandomDataset) -> int:
        from pagedllm import SamplingParams

        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=self.temperature,
                                 top_p=1.0) for n in data.output_lens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in data.prompts], params)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def warmup(self, data: RandomDataset) -> None:
        self._generate(data)

    def run(self, data: RandomDataset) -> float:
        """Seconds for the whole workload; the prefix cache starts empty each time, so a
        repeat gains nothing from the run before it."""
        self.llm.reset_prefix_cache()
        _sync(self.device)
        t0 = time.perf_counter()
        produced = self._generate(data)
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        if produced != data.num_output_tokens:
            raise RuntimeError(f"engine produced {produced} tokens, expected {data.num_output_tokens}")
        return elapsed

    def info(self) -> dict:
        info = {"async_scheduling": self.llm.engine.async_scheduling,
                "batch_invariant": bool(self.llm.engine.config.batch_invariant)}
        stats = self.llm.engine.stats()
        # Sequences preempted (their KV recomputed later) over every run, warm-up included.
        info["num_preemptions"] = stats.num_preemptions
        core = getattr(self.llm.engine, "core", None)  # in-process: of those, swapped instead
        if core is not None and getattr(core.scheduler, "host", None) is not None:
            info["num_swapped_out"] = core.scheduler.num_swapped_out_total
        if stats.spec_num_drafts:
            info["spec_decode"] = {"drafts": stats.spec_num_drafts, "draft_tokens": stats.spec_num_draft_tokens,
                                   "accepted_tokens": stats.spec_num_accepted_tokens}
        return info

    def close(self) -> None:
        self.llm.engine.shutdown()  # tensor-parallel workers exit (in-process: nothing to do)
        del self.llm  # frees the KV pool: the baseline needs the memory on GPU
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _load(name: str, args: argparse.Namespace, cfg: ThroughputConfig, data: RandomDataset,
          vocab: int, device: torch.device, dtype: torch.dtype) -> tuple[Backend, dict]:
    """Load and warm up one backend; returns it with its load and warm-up seconds."""
    t0 = time.perf_counter()
    backend: Backend
    if name == "pagedllm":
        backend = EngineBackend(args, cfg)
        count = args.max_num_seqs
    else:
        from pagedllm.entrypoints.bench_hf import HFBackend, load_hf_model

        if args.hf_dtype is not None:
            dtype = getattr(torch, dtype_name(args.hf_dtype))
        model = load_hf_model(cfg.model, cfg.load_format, dtype, device, args.seed)
        backend = HFBackend(model, cfg.hf_batch_size, args.hf_static_cache, args.temperature,
                            args.seed)
        backend.size_cache(data)
        count = cfg.hf_batch_size
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.warmup > 0:
        # Prompts unrelated to the timed ones (seed + 1), a batch's worth, of the workload's
        # prompt lengths: kernels compiled for the prefill shapes are not timed either.
        backend.warmup(random_dataset(min(count, len(data)), cfg.input_range,
                                      (args.warmup,) * 2, vocab, args.seed + 1))
    _sync(device)
    return backend, {"load_s": round(load_s, 2), "warmup_s": round(time.perf_counter() - t0, 2)}


def run_throughput(args: argparse.Namespace) -> dict:
    """Load, warm up, time; print the figures and a table; return (and write) the result.

    On CPU both backends stay loaded and their timed runs alternate, so that a shared,
    noisy box slows both alike; on GPU they run one after the other, each with the memory.
    """
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    cfg = resolve_config(args)
    if cfg.model is None:
        from pagedllm.config import default_model_path

        cfg.model = default_model_path()
    hf_config = load_hf_config(resolve_source(cfg.model, cfg.load_format))
    vocab = hf_config.vocab_size
    data = random_dataset(cfg.num_prompts, cfg.input_range, cfg.output_range, vocab, args.seed)
    engine_cfg = EngineConfig(model=cfg.model, dtype=cfg.dtype, device=args.device,
                              load_format=cfg.load_format).resolve(hf_config, torch.cuda.is_available())
    device, dtype = torch.device(engine_cfg.device), getattr(torch, engine_cfg.dtype)
    print(f"workload: {cfg.workload or 'custom'}, {len(data)} requests, input "
          f"{cfg.input_range[0]}..{cfg.input_range[1]}, output {cfg.output_range[0]}.."
          f"{cfg.output_range[1]} ({data.num_prompt_tokens} prompt / {data.num_output_tokens} "
          f"output tokens), model {cfg.model} ({cfg.load_format}, {dtype})", flush=True)
    # Before any backend holds the memory: the copy needs 2 GiB for a second.
    ceil = ceilings(device, device_name(device), args.peak_bandwidth, args.peak_tflops)
    if ceil is not None:
        ref = ceil["reference"]
        print(f"ceilings of {ceil['device_name']}: {ceil['bandwidth_TBps']} TB/s "
              f"({ceil['source']['bandwidth']}), {ceil['matmul_TFLOPs']} TFLOP/s "
              f"({ceil['source']['matmul']}); reference "
              + (f"{ref['name']} {ref['bandwidth_TBps']} TB/s, {ref['matmul_TFLOPs']} TFLOP/s"
                 if ref else "none for this card"), flush=True)

    names = ["pagedllm", "hf"] if args.backend == "both" else [args.backend]
    samples: dict[str, list[float]] = {n: [] for n in names}
    extra: dict[str, dict] = {}
    engine_info: dict | None = None

    def timed(name: str, backend: Backend, i: int) -> None:
        samples[name].append(backend.run(data))
        f = figures(samples[name][-1], data)
        print(f"{name} run {i + 1}/{args.repeats}: {f['elapsed_s']:.2f} s, "
              f"{f['output_tokens_per_s']:.2f} output tokens/s", flush=True)

    def done(name: str, backend: Backend) -> None:
        nonlocal engine_info
        if isinstance(backend, EngineBackend):
            engine_info = backend.llm.engine.describe()
        extra[name].update(backend.info())
        backend.close()

    if device.type == "cuda":
        for name in names:
            backend, extra[name] = _load(name, args, cfg, data, vocab, device, dtype)
            for i in range(args.repeats):
                timed(name, backend, i)
            done(name, backend)
    else:
        loaded = {}
        for name in names:
            loaded[name], extra[name] = _load(name, args, cfg, data, vocab, device, dtype)
        for i in range(args.repeats):
            for name in names:
                timed(name, loaded[name], i)
        for name in names:
            done(name, loaded[name])

    results: dict[str, dict] = {}
    for name in names:
        runs = samples[name]
        results[name] = {**figures(statistics.median(runs), data),
                         "elapsed_s_runs": [round(t, 4) for t in runs], **extra[name]}
    result: dict = {
        "benchmark": "throughput",
        "environment": environment(device),
        "args": args_dict(args),
        "workload": {
            "name": cfg.workload, "model": cfg.model, "load_format": cfg.load_format,
            "dtype": str(dtype).replace("torch.", ""), "num_prompts": len(data),
            "input_len_range": list(cfg.input_range), "output_len_range": list(cfg.output_range),
            "prompt_tokens": data.num_prompt_tokens, "output_tokens": data.num_output_tokens,
            "seed": args.seed, "temperature": args.temperature,
            "quantization": cfg.quantization, "kv_cache_dtype": cfg.kv_cache_dtype,
        },
        "engine": engine_info,
        "results": results,
    }
    if cfg.output_range == (1, 1):  # one token out: a run's time is its time to first token
        for name in names:
            results[name]["ttft_s"] = results[name]["elapsed_s"]
            results[name]["ttft_s_runs"] = results[name]["elapsed_s_runs"]
    if "pagedllm" in results and "hf" in results:
        result["ratio"] = round(results["pagedllm"]["output_tokens_per_s"]
                                / results["hf"]["output_tokens_per_s"], 3)
    if ceil is not None:
        result["ceilings"] = ceil
        # The concurrency the page pool allows (a big model on a small card may hold fewer
        # sequences than max_num_seqs at once), counted at the workload's mean length.
        concurrency = args.max_num_seqs
        if engine_info and engine_info.get("kv_tokens"):
            mean_len = statistics.mean(len(p) + o for p, o in zip(data.prompts, data.output_lens, strict=True))
            concurrency = max(1, min(concurrency, int(engine_info["kv_tokens"] // mean_len)))
        roof = {"device_name": ceil["device_name"], "concurrency": concurrency,
                **roofline(hf_config, torch.finfo(dtype).bits // 8,
                           [len(p) for p in data.prompts], data.output_lens, concurrency,
                           ceil["bandwidth_TBps"], ceil["matmul_TFLOPs"],
                           weight_bytes=1 if cfg.quantization == "fp8" else None,
                           kv_bytes=1 if cfg.kv_cache_dtype.startswith("fp8") else None)}
        if "pagedllm" in results:
            roof["achieved_fraction"] = round(
                results["pagedllm"]["output_tokens_per_s"] / roof["output_tokens_per_s"], 4)
        result["roofline"] = roof
    _print_table(result)
    if args.output_json:
        write_json(args.output_json, result)
        print(f"wrote {args.output_json}")
    return result


def _print_table(result: dict) -> None:
    rows = [("backend", "elapsed s", "req/s", "total tok/s", "output tok/s")]
    for name, f in result["results"].items():
        rows.append((name, f"{f['elapsed_s']:.2f}", f"{f['requests_per_s']:.2f}",
                     f"{f['total_tokens_per_s']:.1f}", f"{f['output_tokens_per_s']:.1f}"))
    if "roofline" in result:
        r = result["roofline"]
        rows.append(("roofline", f"{r['total_s']:.2f}", "", "", f"{r['output_tokens_per_s']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    env = result["environment"]
    print(f"\n{env['device_name']} | torch {env['torch']} | commit "
          f"{(env['git'].get('short') or '?')}{' (dirty)' if env['git'].get('dirty') else ''}")
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    if "roofline" in result:
        r, c = result["roofline"], result["ceilings"]
        print(f"roofline at {r['bandwidth_TBps']} TB/s ({c['source']['bandwidth']}), "
              f"{r['matmul_TFLOPs']} TFLOP/s ({c['source']['matmul']})"
              + (f": achieved {r['achieved_fraction']:.1%}" if "achieved_fraction" in r else ""))
    if "ratio" in result:
        print(f"pagedllm / hf output tok/s: {result['ratio']:.2f}x")
