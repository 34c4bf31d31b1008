"""GGUF checkpoints (llama.cpp's format): config and weights from one file (the tokenizer
from the same file: pagedllm.tokenizers.loading).

Weights are dequantized to float at load with the `gguf` package's own dequantizers, except
where a packed kernel exists: Q4_0 and Q8_0 blocks are exactly GPTQ groups of 32 (one fp16
scale, a constant zero point), so on CUDA the decoder's linear layers get the GGUF-packed
weight method (layers/quantization/gguf.py), are handed the file's raw blocks and stay 4
(or 8) bits in memory (gguf_quant_config).
llama.cpp's converter permutes the rows of the Llama q/k projections (to interleaved rope
pairs); we undo that so the tensors match the Hugging Face layout our model uses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from pagedllm.distributed import get_tp_world_size
from pagedllm.model_executor.layers.quantization.config import QuantConfig
from pagedllm.model_executor.layers.quantization.gguf import PACKABLE_TYPES
from pagedllm.model_executor.loader.gguf_header import GGUFHeader

# GGUF architecture -> (HF architecture, q/k rows permuted by the converter)
_ARCHS = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The decoder's linear layers: the only tensors that may be kept packed (embeddings, norms
# and the output head stay float, as for GPTQ checkpoints).
_LINEAR = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# Pack on CPU too. Off by default: CPU layers keep a dequantized copy next to the packed
# words, so packing there only adds memory; tests turn it on to check the packed path.
PACK_ON_CPU = False

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@functools.lru_cache(maxsize=2)
def _reader(path: str) -> GGUFHeader:
    """The header, read once per process (gguf_header.py says why not with GGUFReader)."""
    return GGUFHeader(path)


def gguf_config(path: str):
    """A transformers config equivalent to the GGUF metadata."""
    from transformers import AutoConfig

    reader = _reader(path)
    arch = reader.fields.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    hf_arch, _ = _ARCHS[arch]

    def key(name, default=None):
        return reader.fields.get(f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    kwargs = dict(
        architectures=[hf_arch],
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length", hidden // heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=key("context_length", 4096),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=reader.fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.fields.get("tokenizer.ggml.eos_token_id"),
    )
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    if key("rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[hf_arch]
    config = AutoConfig.for_model(model_type, **kwargs)
    # transformers 4.x reads rope_theta/rope_scaling, 5.x reads rope_parameters.
    config.rope_theta = rope["rope_theta"]
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    if rope["rope_type"] != "default":
        config.rope_scaling = rope
    return config


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _is_linear_weight(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR and parts[3] == "weight"


def gguf_quant_config(path: str, device: torch.device) -> QuantConfig | None:
    """The packed layout for this file's linear layers on `device`, or None to dequantize
    at load (today's path, which always works).

    Packing needs a kernel to pay off, so it is CUDA only (PACK_ON_CPU forces it). One
    QuantConfig covers every layer, so all the decoder's linear weights must share one
    packable type; a mixed file (e.g. llama.cpp's Q4_K_M, or Q4_0 with some Q8_0 layers)
    falls back to dequantizing rather than half-packing a fused qkv or gate/up layer.
    """
    if device.type != "cuda" and not PACK_ON_CPU:
        return None
    import gguf

    reader = _reader(path)
    linear = [t for t in reader.tensors if _is_linear_weight(t.name)]
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in linear}
    if len(types) != 1 or (bits := PACKABLE_TYPES.get(qtype := types.pop())) is None:
        return None
    pack = 32 // bits
    world = get_tp_world_size()

    def fits(t) -> bool:
        """The packed method packs `pack` output features per zeros word and splits
        row-parallel inputs by whole blocks of 32, per tensor-parallel rank; a file whose
        layers it cannot hold stays on the float path rather than failing to load. (k/v may be
        replicated over ranks, so only their whole size is checked.)"""
        n_in, n_out = int(t.shape[0]), int(t.shape[1])  # ggml order: shape[0] is the input
        per_rank_out = n_out if t.name.split(".")[2] in ("attn_k", "attn_v") else n_out // world
        return n_in % (32 * world) == 0 and n_out % pack == 0 and n_out % world == 0 and per_rank_out % pack == 0

    if not all(fits(t) for t in linear):
        return None
    return QuantConfig("gguf", bits, 32, qtype.lower())


def gguf_weights(path: str, config, quant: QuantConfig | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, tensor) for every tensor in the file: float32, or with `quant`
    (from gguf_quant_config) the decoder's linear weights as the file's raw blocks (uint8
    [out, bytes per row]), which their GGUF-packed layers unpack."""
    import gguf

    reader = _reader(path)
    arch = reader.fields.get("general.architecture")
    _, permuted = _ARCHS[arch]
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, base, suffix = parts[1], parts[2], parts[3]
            if base not in _LAYER_NAMES:
                raise ValueError(f"GGUF tensor {t.name!r} is not supported")
            name = f"model.layers.{layer}.{_LAYER_NAMES[base]}.{suffix}"
        else:
            base, suffix = parts[0], parts[1]
            if base == "rope_freqs":
                continue  # recomputed from the config
            name = f"{_GLOBAL_NAMES[base]}.{suffix}"
        # llama.cpp's converter permuted the q/k rows (output features); undone on the
        # float rows, or on the whole block rows when kept packed (a row's blocks hold its
        # scales, and the zero point is one constant).
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(base)
        if quant is not None and _is_linear_weight(t.name):
            qtype = gguf.GGMLQuantizationType(t.tensor_type).name
            if qtype.lower() != quant.checkpoint_format:
                raise ValueError(f"GGUF tensor {t.name!r} is {qtype}, not {quant.checkpoint_format.upper()}")
            data = t.data
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and heads:
            data = _unpermute(data, heads)
        data = np.ascontiguousarray(data)
        yield name, torch.from_numpy(data if data.flags.writeable else data.copy())
