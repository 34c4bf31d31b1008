"""GGUF checkpoints (llama.cpp's format): config, weights and tokenizer from one file.

Weights are dequantized to float at load with the `gguf` package's own dequantizers.
llama.cpp's converter permutes the rows of the Llama q/k projections (to interleaved rope
pairs); we undo that so the tensors match the Hugging Face layout our model uses.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    """Parsing the header (tens of thousands of vocabulary entries) takes seconds: once."""
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(path: str):
    """A transformers config equivalent to the GGUF metadata."""
    from transformers import AutoConfig

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHS)}")
    hf_arch, _ = _ARCHS[arch]

    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
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
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
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


def gguf_weights(path: str, config) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, float32 tensor) for every tensor in the file."""
    import gguf

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
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
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if permuted and base == "attn_q":
            data = _unpermute(data, config.num_attention_heads)
        elif permuted and base == "attn_k":
            data = _unpermute(data, config.num_key_value_heads)
        data = np.ascontiguousarray(data)
        yield name, torch.from_numpy(data if data.flags.writeable else data.copy())


def gguf_tokenizer(path: str):
    """transformers builds a fast tokenizer (with the chat template) from GGUF metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
