"""A roofline for a throughput workload: the best any engine could do on given ceilings.

Decode is bound by memory: each step reads every weight once plus each running request's KV
cache. Prefill is bound by matmul rate. The estimate assumes perfect continuous batching
(decode steps = max(longest output, total output / concurrent requests)) and no overlap,
which is the method behind the roofline row of the project's benchmark notes.
"""

from __future__ import annotations

# Ceilings measured on the lent H200: copy bandwidth and bf16 matmul rate.
H200_BANDWIDTH_TBPS = 4.24
H200_MATMUL_TFLOPS = 786.0


def model_shape(hf_config) -> dict[str, int]:
    """Sizes the roofline needs, from a transformers config."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    return {
        "hidden": hidden,
        "layers": hf_config.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(hf_config, "head_dim", None) or hidden // heads,
        "ffn": hf_config.intermediate_size,
        "vocab": hf_config.vocab_size,
    }


def matmul_params(shape: dict[str, int]) -> int:
    """Weights a decode step reads: every layer's projections plus the LM head (the input
    embedding is a gather of a few rows, so it is left out; tied or not, the head is read)."""
    h, d = shape["hidden"], shape["head_dim"]
    attn = h * d * (2 * shape["heads"] + 2 * shape["kv_heads"])
    mlp = 3 * h * shape["ffn"]
    return shape["layers"] * (attn + mlp) + shape["vocab"] * h


def roofline(hf_config, dtype_bytes: int, input_lens: list[int], output_lens: list[int],
             max_num_seqs: int, bandwidth_tbps: float, matmul_tflops: float) -> dict:
    """Seconds and output tokens/s at the ceilings, split into its three terms."""
    s = model_shape(hf_config)
    params = matmul_params(s)
    kv_bytes_per_token = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * dtype_bytes
    total_out = sum(output_lens)
    concurrent = max(1, min(len(output_lens), max_num_seqs))
    steps = max(max(output_lens), -(-total_out // concurrent))
    bw = bandwidth_tbps * 1e12
    weights_s = steps * params * dtype_bytes / bw
    # Step t of a request reads its prompt plus the t tokens generated before it.
    kv_tokens = sum(o * i + o * (o - 1) // 2 for i, o in zip(input_lens, output_lens, strict=True))
    kv_s = kv_tokens * kv_bytes_per_token / bw
    # Prefill: 2 FLOPs per weight per token (the LM head only for the last token) and causal
    # attention (QK^T and PV, 2 FLOPs each per head dim per earlier position).
    layer_params = params - s["vocab"] * s["hidden"]
    attn_per_pos = 4 * s["layers"] * s["heads"] * s["head_dim"]
    prefill_flops = sum(2 * layer_params * n + attn_per_pos * n * (n - 1) // 2 for n in input_lens)
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
