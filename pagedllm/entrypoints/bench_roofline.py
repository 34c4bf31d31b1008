"""A roofline for a throughput workload: the best any engine could do on given ceilings.

Decode is bound by memory: each step reads every weight once plus each running request's KV
cache. Prefill is bound by matmul rate. The estimate assumes perfect continuous batching
(decode steps = max(longest output, total output / concurrent requests)) and no overlap,
which is the method behind the roofline row of the project's benchmark notes.

The ceilings belong to the card the run got: the device tool lends an H100 (about 3.0 TB/s)
or an H200 (about 4.3 TB/s), so a fixed pair would misstate the roofline on one of them.
`measure_ceilings` times them at the start of a run; `KNOWN_CARDS` keeps what was measured
here before, recorded beside the new figures so that a slow or throttled card shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Card:
    """Ceilings of one kind of card as measured here (the benchmark notes' "Cards")."""

    name: str
    bandwidth_tbps: float  # device-to-device copy, bytes read + written
    matmul_tflops: float  # dense bf16 matmul

    def as_dict(self) -> dict:
        return {"name": self.name, "bandwidth_TBps": self.bandwidth_tbps,
                "matmul_TFLOPs": self.matmul_tflops}


# (substrings all found in torch.cuda.get_device_name, the card). The H100 SXM reports
# "NVIDIA H100 80GB HBM3"; the PCIe and NVL parts have other memory and are not listed.
KNOWN_CARDS: list[tuple[tuple[str, ...], Card]] = [
    (("H200",), Card("H200", 4.24, 786.0)),
    (("H100", "HBM3"), Card("H100 SXM", 3.0, 790.0)),
]
H200 = KNOWN_CARDS[0][1]


def known_card(device_name: str) -> Card | None:
    """The reference ceilings of a card by its CUDA name, or None for one not measured here."""
    for keys, card in KNOWN_CARDS:
        if all(k in device_name for k in keys):
            return card
    return None


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one untimed one: the best run is the one the
    card's clocks and the other tenants disturbed least. CUDA events time the device alone."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def _copy_seconds(device: torch.device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), device, repeats)


def _matmul_seconds(device: torch.device, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    for _ in range(3):  # the clocks rise under load before the timed products
        torch.mm(a, b, out=out)
    return _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)


def _digits(x: float) -> float:
    """Four significant digits: a card's 786.3 TFLOP/s and a test's 0.01234 alike."""
    return float(f"{x:.4g}")


def measure_ceilings(device: torch.device, copy_bytes: int = 1 << 30, matmul_n: int = 8192,
                     repeats: int = 5) -> dict:
    """Copy bandwidth and bf16 matmul rate of `device`, timed now (about a second on an
    H100/H200 with the defaults; the buffers, 2 GiB and 384 MiB, are freed before return).

    Bandwidth counts the bytes read plus the bytes written by one device-to-device copy, as
    the benchmark notes' figures do; the matmul rate counts 2*n^3 FLOPs for each n x n x n product.
    Both are the best of `repeats` runs, so a card that throttles shows a lower ceiling than
    its reference, never a higher one.
    """
    t0 = time.perf_counter()
    copy_s = _copy_seconds(device, copy_bytes, repeats)
    mm_s = _matmul_seconds(device, matmul_n, repeats)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return {
        "bandwidth_TBps": _digits(2 * copy_bytes / copy_s / 1e12),
        "matmul_TFLOPs": _digits(2 * matmul_n**3 / mm_s / 1e12),
        "copy_bytes": copy_bytes,
        "matmul_shape": [matmul_n] * 3,
        "repeats": repeats,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def ceilings(device: torch.device, device_name: str, peak_bandwidth: float | None,
             peak_tflops: float | None, measure: Callable[[torch.device], dict] = measure_ceilings,
             ) -> dict | None:
    """The ceilings a roofline uses and where each came from, or None without any (CPU with
    no flags). Flags win over the measurement; on CUDA what is not given is measured; on CPU
    both flags are needed (a CPU's roofline is not this project's concern unless asked)."""
    measured = measure(device) if device.type == "cuda" else None
    if measured is None and (peak_bandwidth is None or peak_tflops is None):
        return None
    card = known_card(device_name)

    def pick(flag: float | None, key: str) -> tuple[float, str]:
        if flag is not None:
            return flag, "flag"
        assert measured is not None
        return measured[key], "measured"

    bw, bw_from = pick(peak_bandwidth, "bandwidth_TBps")
    tf, tf_from = pick(peak_tflops, "matmul_TFLOPs")
    return {
        "device_name": device_name,
        "bandwidth_TBps": bw,
        "matmul_TFLOPs": tf,
        "source": {"bandwidth": bw_from, "matmul": tf_from},
        "measured": measured,
        "reference": card.as_dict() if card is not None else None,
    }


def model_shape(hf_config) -> dict[str, int]:
    """Sizes the roofline needs, from a transformers config (MoE: the experts' too). Per
    layer: `attn` weights of the attention projections, `kv` cached values a token,
    `attn_pos` prefill FLOPs per (query, earlier key) pair; MLA (DeepSeek) included."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    experts = (getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
               or getattr(hf_config, "n_routed_experts", None) or 0)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    if getattr(hf_config, "kv_lora_rank", None):  # multi-head latent attention
        r, dr, dn, dv = (hf_config.kv_lora_rank, hf_config.qk_rope_head_dim,
                         hf_config.qk_nope_head_dim, hf_config.v_head_dim)
        ql = getattr(hf_config, "q_lora_rank", None)
        q = (hidden * ql + ql * heads * (dn + dr)) if ql else hidden * heads * (dn + dr)
        attn = q + hidden * (r + dr) + r * heads * (dn + dv) + heads * dv * hidden
        kv, attn_pos = r + dr, 2 * heads * (dn + dr + dv)  # the latent; scores + weighted sum
        shared = shared or (getattr(hf_config, "n_shared_experts", 0) or 0) * hf_config.moe_intermediate_size
    else:
        d = getattr(hf_config, "head_dim", None) or hidden // heads
        attn = hidden * d * (2 * heads + 2 * kv_heads)
        kv, attn_pos = 2 * kv_heads * d, 4 * heads * d
    return {
        "hidden": hidden,
        "layers": hf_config.num_hidden_layers,
        "attn": attn,
        "kv": kv,
        "attn_pos": attn_pos,
        "ffn": hf_config.intermediate_size,
        "vocab": hf_config.vocab_size,
        "experts": experts,
        # DeepSeek: the first layers keep a dense MLP
        "dense_layers": (getattr(hf_config, "first_k_dense_replace", 0) or 0) if experts else 0,
        "top_k": getattr(hf_config, "num_experts_per_tok", 0) if experts else 0,
        "expert_ffn": (getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)
        if experts else 0,
        "shared_ffn": shared,
    }


def distinct_experts(shape: dict[str, int], tokens: float) -> float:
    """Experts a step's tokens route to, expected under uniform routing: each of E experts
    is missed by one token's k choices with probability 1 - k/E."""
    e, k = shape["experts"], shape["top_k"]
    return e * (1.0 - (1.0 - k / e) ** tokens)


def matmul_params(shape: dict[str, int], tokens: float = 1.0) -> int:
    """Weights a decode step of `tokens` sequences reads: every layer's projections plus
    the LM head (the input embedding is a gather of a few rows, so it is left out; tied or
    not, the head is read). An MoE layer reads its router, its shared expert and only the
    distinct experts the step's tokens route to."""
    h, attn = shape["hidden"], shape["attn"]
    dense = shape.get("dense_layers", 0)
    if shape.get("experts"):
        mlp = (distinct_experts(shape, tokens) * 3 * h * shape["expert_ffn"]
               + 3 * h * shape["shared_ffn"] + h * shape["experts"])
        return int((shape["layers"] - dense) * (attn + mlp) + dense * (attn + 3 * h * shape["ffn"])
                   + shape["vocab"] * h)
    mlp = 3 * h * shape["ffn"]
    return int(shape["layers"] * (attn + mlp) + shape["vocab"] * h)


def active_params(shape: dict[str, int]) -> int:
    """Weights one token multiplies by (MoE: its k experts): what prefill FLOPs count."""
    if not shape.get("experts"):
        return matmul_params(shape) - shape["vocab"] * shape["hidden"]
    h, attn = shape["hidden"], shape["attn"]
    dense = shape.get("dense_layers", 0)
    mlp = shape["top_k"] * 3 * h * shape["expert_ffn"] + 3 * h * shape["shared_ffn"] + h * shape["experts"]
    return (shape["layers"] - dense) * (attn + mlp) + dense * (attn + 3 * h * shape["ffn"])


def roofline(hf_config, dtype_bytes: int, input_lens: list[int], output_lens: list[int],
             max_num_seqs: int, bandwidth_tbps: float, matmul_tflops: float,
             weight_bytes: int | None = None, kv_bytes: int | None = None) -> dict:
    """Seconds and output tokens/s at the ceilings, split into its three terms.

    `weight_bytes` (FP8: 1) sizes the layers' projections, whose prefill FLOPs then run at
    twice `matmul_tflops` (FP8 tensor cores); the LM head stays in `dtype_bytes`, as the
    engine keeps it. `kv_bytes` (FP8 KV: 1) sizes the K/V pages."""
    s = model_shape(hf_config)
    concurrent = max(1, min(len(output_lens), max_num_seqs))
    params = matmul_params(s, concurrent)
    head = s["vocab"] * s["hidden"]
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    kv_bytes_per_token = s["layers"] * s["kv"] * (kv_bytes or dtype_bytes)
    total_out = sum(output_lens)
    steps = max(max(output_lens), -(-total_out // concurrent))
    bw = bandwidth_tbps * 1e12
    weights_s = steps * ((params - head) * wb + head * dtype_bytes) / bw
    # Step t of a request reads its prompt plus the t tokens generated before it.
    kv_tokens = sum(o * i + o * (o - 1) // 2 for i, o in zip(input_lens, output_lens, strict=True))
    kv_s = kv_tokens * kv_bytes_per_token / bw
    # Prefill: 2 FLOPs per weight per token (the LM head only for the last token) and causal
    # attention (QK^T and PV, 2 FLOPs each per head dim per earlier position).
    layer_params = active_params(s)
    attn_per_pos = s["layers"] * s["attn_pos"]
    linear_speedup = dtype_bytes / wb  # FP8 products run at twice the bf16 rate
    prefill_flops = sum(2 * layer_params * n / linear_speedup + attn_per_pos * n * (n - 1) // 2
                        for n in input_lens)
    prefill_flops += 2 * s["vocab"] * s["hidden"] * len(input_lens)
    prefill_s = prefill_flops / (matmul_tflops * 1e12)
    total_s = weights_s + kv_s + prefill_s
    return {
        "bandwidth_TBps": bandwidth_tbps,
        "matmul_TFLOPs": matmul_tflops,
        "decode_steps": steps,
        "weights_read_s": round(weights_s, 4),
        "kv_read_s": round(kv_s, 4),
        "prefill_s": round(prefill_s, 4),
        "total_s": round(total_s, 4),
        "output_tokens_per_s": round(total_out / total_s, 1),
    }
