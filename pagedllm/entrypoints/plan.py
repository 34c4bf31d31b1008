"""`pagedllm plan`: how a model fits in memory, without loading its weights.

For each dtype / quantization it prints the weight memory, the KV bytes per token, and how
many blocks, tokens and full-length sequences the pool holds, using the same sizing rules
as the engine (pagedllm.memory). Parameters are counted on PyTorch's meta device, so even
a 70B config is planned in a second on a laptop.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch

from pagedllm.config import parse_bytes
from pagedllm.memory import (
    blocks_for_bytes,
    cpu_num_blocks,
    full_length_sequences,
)
from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.parallel import ParallelLMHead
from pagedllm.model_executor.loader.loader import load_hf_config
from pagedllm.model_executor.models import resolve_architecture
from pagedllm.model_source import resolve_source
from pagedllm.worker.lora_manager import lora_slot_bytes

# name -> (bytes per weight of the linear layers, bytes per element of everything else and KV)
WEIGHT_FORMATS = {
    "float32": (4.0, 4),
    "bfloat16": (2.0, 2),
    # FP8 e4m3 weights on a GPU with FP8 tensor cores (+ a float32 scale per output row,
    # under 0.1% at 4096 inputs); on CPU and older GPUs they are dequantized to the dtype
    "fp8 (e4m3)": (1.0, 2),
    "int8 (8-bit GPTQ)": (1.0 + 2 / 128, 2),
    "int4 (GPTQ/AWQ g128)": (0.5 + 4 / 128, 2),  # + fp16 scale and packed zero per group
}


@dataclass
class PlanRow:
    format: str
    weights_GiB: float
    weights_bytes: int
    kv_bytes_per_token: int
    kv_blocks: int
    kv_tokens: int
    seqs_at_max_len: float


def _meta_model(hf_config):
    """The model we would build, on the meta device: shapes only, no memory."""
    arch, cls = resolve_architecture(hf_config)
    with torch.device("meta"):
        return cls(hf_config, arch, 1, None)


def count_parameters(hf_config, model=None) -> tuple[int, int]:
    """(parameters in linear layers, all other parameters) of the model we would build."""
    model = model if model is not None else _meta_model(hf_config)
    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, LinearBase | ParallelLMHead) and m.weight is not getattr(
                     model.model.embed_tokens, "weight", None))
    total = sum(p.numel() for p in model.parameters())
    return linear, total - linear


def _page_fields(pages) -> dict:
    """What one token of one layer holds: K/V heads and head size, or an MLA latent."""
    if pages.kind == "kv":
        kv_heads, head_dim = pages.token_shape
        return {"kv_heads": kv_heads, "head_dim": head_dim, "kv_pages": pages.describe()}
    return {"kv_pages": pages.describe()}


def plan_rows(model: str | None, max_model_len: int | None = None, block_size: int | None = None,
              gpu_memory: float | None = None, gpu_memory_utilization: float = 0.9,
              kv_cache_memory: int | None = None, max_num_seqs: int | None = None,
              max_num_batched_tokens: int | None = None, load_format: str = "auto",
              revision: str | None = None,
              download_dir: str | None = None,
              kv_cache_dtype: str = "auto", max_loras: int = 0,
              max_lora_rank: int = 64) -> tuple[dict, list[PlanRow]]:
    """`max_loras` > 0: the adapter slots (LoRA) of that many adapters of rank
    `max_lora_rank` come out of the GPU memory before the KV pool."""
    from pagedllm.config import EngineConfig

    given = {"block_size": block_size, "max_num_seqs": max_num_seqs}  # None: the engine's default
    cfg = EngineConfig(model=model, load_format=load_format, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens,
                       **{k: v for k, v in given.items() if v is not None})
    block_size, max_num_seqs = cfg.block_size, cfg.max_num_seqs
    hf = load_hf_config(resolve_source(cfg.model, load_format, revision, download_dir,
                                        config_only=True))
    on_gpu = gpu_memory is not None
    # The engine's own defaults, for the device the plan is for.
    cfg = cfg.resolve(hf, cuda_available=on_gpu)
    arch, _ = resolve_architecture(hf)
    model = _meta_model(hf)
    # what a token costs in the pages: the attention layers' own answer (K and V, an MLA latent)
    pages = model.page_spec
    layers = model.shape.num_layers
    max_len = cfg.max_model_len
    linear, other = count_parameters(hf, model)
    budget_tokens = cfg.max_num_batched_tokens
    rows = []
    lora_per_elem = lora_slot_bytes(model, max_loras, max_lora_rank, 1) if max_loras else 0
    for name, (w_bytes, elem) in WEIGHT_FORMATS.items():
        weights = linear * w_bytes + other * elem
        lora = lora_per_elem * elem  # slots in the activations' dtype
        # an fp8 KV cache holds one byte an element, whatever the weights are
        kv_elem = 1 if kv_cache_dtype.startswith("fp8") else elem
        per_token = pages.bytes_per_token(layers, kv_elem)
        per_block = per_token * block_size
        if on_gpu:
            # Activations of the largest step, as the engine's profiling pass would see them.
            act = budget_tokens * (4 * hf.hidden_size + 3 * hf.intermediate_size) * elem
            act += min(budget_tokens, 256) * hf.vocab_size * 4 * 2 + budget_tokens * per_token
            free = gpu_memory * 2**30 * gpu_memory_utilization - weights - act - lora
            blocks = blocks_for_bytes(int(free), per_block) if free >= per_block else 0
        else:
            blocks = cpu_num_blocks(kv_cache_memory, per_block, max_num_seqs, max_len, block_size)
        rows.append(PlanRow(name, round(weights / 2**30, 3), int(weights), per_token, blocks, blocks * block_size,
                            round(blocks * block_size / max_len, 2)))
    info = {"model": cfg.model, "architecture": arch, "parameters": linear + other,
            "layers": layers, **_page_fields(pages), "max_model_len": max_len,
            "block_size": block_size, "kv_cache_dtype": kv_cache_dtype,
            **({"lora_slots": f"{max_loras} x rank {max_lora_rank}: "
                              f"{lora_per_elem * 2 / 2**30:.3f} GiB in 16-bit"} if max_loras else {}),
            "memory": f"{gpu_memory} GiB GPU x {gpu_memory_utilization}"
            if on_gpu else f"CPU, kv_cache_memory={kv_cache_memory or 'default'}"}
    return info, rows


def add_plan_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="how a model fits in memory (no weights loaded)")
    p.add_argument("model_tag", nargs="?", default=None, help="model path or hub id (default: SmolLM2)")
    p.add_argument("--model", default=None)
    p.add_argument("--max-model-len", "--max-context-length", dest="max_model_len", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--gpu-memory", type=float, help="GPU memory in GiB (plans for a GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", help="CPU pool size, e.g. 4GiB")
    p.add_argument("--max-num-seqs", "--max-concurrent-requests", dest="max_num_seqs", type=int)
    p.add_argument("--max-num-batched-tokens", "--max-tokens-per-batch", dest="max_num_batched_tokens", type=int)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="plan for an fp8 KV cache (one byte an element)")
    p.add_argument("--enable-lora", action="store_true",
                   help="set aside the adapter slots of multi-LoRA serving")
    p.add_argument("--max-loras", type=int, default=4, help="adapter slots (with --enable-lora)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="slot rank (with --enable-lora)")
    p.add_argument("--revision", help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--download-dir", metavar="DIR",
                   help="Hugging Face cache for hub ids (default: $HF_HUB_CACHE, else $HF_HOME/hub)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:  # the engine's own rules, with its words: one clean line, as `serve` gives
        info, rows = plan_rows(args.model or args.model_tag, args.max_model_len, args.block_size,
                               args.gpu_memory, args.gpu_memory_utilization,
                               parse_bytes(args.kv_cache_memory), args.max_num_seqs,
                               args.max_num_batched_tokens, args.load_format,
                               args.revision, args.download_dir, args.kv_cache_dtype,
                               args.max_loras if args.enable_lora else 0, args.max_lora_rank)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"pagedllm plan: {e}") from None
    for k, v in info.items():
        print(f"{k:>16}: {v}")
    cols = list(asdict(rows[0]))
    print()
    print("  ".join(f"{c:>22}" if i == 0 else f"{c:>18}" for i, c in enumerate(cols)))
    for r in rows:
        print("  ".join(f"{v!s:>22}" if i == 0 else f"{v!s:>18}" for i, v in enumerate(asdict(r).values())))
    print()  # in words, as the engine's start-up log says it
    for r in rows:
        print(f"{r.format:>22}: {full_length_sequences(r.kv_tokens, info['max_model_len'])}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args()
    raise SystemExit(a.func(a))
