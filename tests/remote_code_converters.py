"""Test-side converters: a tiny HF reference model -> the ORIGINAL remote-code checkpoint
layout (config.json with the original architectures/auto_map/key names, safetensors with
the original tensor names), following the project's format notes."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def _write(path: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


def _sd(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _auto_map(module: str, config_cls: str, model_cls: str) -> dict:
    return {"AutoConfig": f"configuration_{module}.{config_cls}",
            "AutoModelForCausalLM": f"modeling_{module}.{model_cls}"}


def _layers(c) -> range:
    return range(c.num_hidden_layers)


def to_internlm2(model, path: str) -> str:
    c, sd = model.config, _sd(model)
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    d, r = c.hidden_size // nh, nh // nkv
    out = {"model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
           "model.norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    for i in _layers(c):
        p = f"model.layers.{i}"
        q = sd[f"{p}.self_attn.q_proj.weight"].view(nkv, r, d, -1)
        k = sd[f"{p}.self_attn.k_proj.weight"].view(nkv, 1, d, -1)
        v = sd[f"{p}.self_attn.v_proj.weight"].view(nkv, 1, d, -1)
        out[f"{p}.attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, c.hidden_size)
        out[f"{p}.attention.wo.weight"] = sd[f"{p}.self_attn.o_proj.weight"]
        out[f"{p}.attention_norm.weight"] = sd[f"{p}.input_layernorm.weight"]
        out[f"{p}.ffn_norm.weight"] = sd[f"{p}.post_attention_layernorm.weight"]
        out[f"{p}.feed_forward.w1.weight"] = sd[f"{p}.mlp.gate_proj.weight"]
        out[f"{p}.feed_forward.w3.weight"] = sd[f"{p}.mlp.up_proj.weight"]
        out[f"{p}.feed_forward.w2.weight"] = sd[f"{p}.mlp.down_proj.weight"]
    cfg = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
           "auto_map": _auto_map("internlm2", "InternLM2Config", "InternLM2ForCausalLM"),
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
           "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None, "bias": False,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": False,
           "torch_dtype": "float32", "attn_implementation": "eager"}
    return _write(path, cfg, out)


def to_internlm(model, path: str) -> str:
    """Llama names unchanged; the reference has attention_bias=True (q, k, v and o)."""
    c = model.config
    cfg = {"architectures": ["InternLMForCausalLM"], "model_type": "internlm",
           "auto_map": _auto_map("internlm", "InternLMConfig", "InternLMForCausalLM"),
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
           "bias": True, "rotary": {"base": c.rope_parameters["rope_theta"], "type": "origin"},
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    return _write(path, cfg, _sd(model))


def to_internlm3(model, path: str) -> str:
    """Llama names unchanged; `qkv_bias` and `bias` both follow the reference's
    attention_bias (q/k/v/o) and mlp_bias, which must agree."""
    c = model.config
    assert c.attention_bias == c.mlp_bias
    cfg = {"architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3",
           "auto_map": _auto_map("internlm3", "InternLM3Config", "InternLM3ForCausalLM"),
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
           "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
           "qkv_bias": c.attention_bias, "bias": c.mlp_bias,
           "rope_theta": c.rope_parameters["rope_theta"], "rope_scaling": None,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    return _write(path, cfg, _sd(model))


def to_baichuan(model, path: str, arch: str = "BaiChuanForCausalLM", **extra) -> str:
    """W_pack = [q | k | v] (MHA). `extra` adds raw config keys (e.g. norm_head)."""
    c, sd = model.config, _sd(model)
    assert c.num_key_value_heads == c.num_attention_heads
    out = {}
    for name, t in sd.items():
        if ".self_attn.q_proj." in name:
            p = name.replace(".q_proj.", ".{}.")
            out[p.format("W_pack")] = torch.cat([sd[p.format(x)] for x in ("q_proj", "k_proj", "v_proj")])
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        else:
            out[name] = t
    module = "baichuan"
    cfg = {"architectures": [arch], "model_type": "baichuan",
           "auto_map": _auto_map(module, "BaiChuanConfig" if arch == "BaiChuanForCausalLM"
                                 else "BaichuanConfig", arch),
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
           "model_max_length": c.max_position_embeddings, "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 0, "tie_word_embeddings": False, "torch_dtype": "float32", **extra}
    return _write(path, cfg, out)


def to_qwen(model, path: str) -> str:
    """From a Qwen2 reference (MHA, q/k/v bias): c_attn = [q|k|v], w2 = gate, w1 = up,
    config intermediate_size = 2x the real width."""
    c, sd = model.config, _sd(model)
    assert c.num_key_value_heads == c.num_attention_heads
    out = {"transformer.wte.weight": sd["model.embed_tokens.weight"],
           "transformer.ln_f.weight": sd["model.norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in _layers(c):
        p, q = f"model.layers.{i}", f"transformer.h.{i}"
        for kind in ("weight", "bias"):
            out[f"{q}.attn.c_attn.{kind}"] = torch.cat(
                [sd[f"{p}.self_attn.{x}_proj.{kind}"] for x in "qkv"])
        out[f"{q}.attn.c_proj.weight"] = sd[f"{p}.self_attn.o_proj.weight"]
        out[f"{q}.ln_1.weight"] = sd[f"{p}.input_layernorm.weight"]
        out[f"{q}.ln_2.weight"] = sd[f"{p}.post_attention_layernorm.weight"]
        out[f"{q}.mlp.w2.weight"] = sd[f"{p}.mlp.gate_proj.weight"]
        out[f"{q}.mlp.w1.weight"] = sd[f"{p}.mlp.up_proj.weight"]
        out[f"{q}.mlp.c_proj.weight"] = sd[f"{p}.mlp.down_proj.weight"]
    cfg = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen",
           "auto_map": _auto_map("qwen", "QWenConfig", "QWenLMHeadModel"),
           "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
           "num_hidden_layers": c.num_hidden_layers, "kv_channels": c.hidden_size // c.num_attention_heads,
           "intermediate_size": 2 * c.intermediate_size, "layer_norm_epsilon": c.rms_norm_eps,
           "rotary_emb_base": c.rope_parameters["rope_theta"], "rotary_pct": 1.0,
           "seq_length": c.max_position_embeddings, "vocab_size": c.vocab_size, "no_bias": True,
           "use_dynamic_ntk": True, "use_logn_attn": True, "bf16": False, "fp16": False,
           "fp32": False, "tie_word_embeddings": False, "tokenizer_class": "QWenTokenizer"}
    return _write(path, cfg, out)


def to_chatglm(model, path: str) -> str:
    """From a transformers GLM reference (qkv bias, gate|up fused, half-head interleaved
    rotary) to THUDM ChatGLM2/3 names and config keys."""
    c, sd = model.config, _sd(model)
    out = {"transformer.embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "transformer.encoder.final_layernorm.weight": sd["model.norm.weight"],
           "transformer.output_layer.weight": sd["lm_head.weight"]}
    for i in _layers(c):
        p, q = f"model.layers.{i}", f"transformer.encoder.layers.{i}"
        for kind in ("weight", "bias"):
            out[f"{q}.self_attention.query_key_value.{kind}"] = torch.cat(
                [sd[f"{p}.self_attn.{x}_proj.{kind}"] for x in "qkv"])
        out[f"{q}.self_attention.dense.weight"] = sd[f"{p}.self_attn.o_proj.weight"]
        out[f"{q}.input_layernorm.weight"] = sd[f"{p}.input_layernorm.weight"]
        out[f"{q}.post_attention_layernorm.weight"] = sd[f"{p}.post_attention_layernorm.weight"]
        out[f"{q}.mlp.dense_h_to_4h.weight"] = sd[f"{p}.mlp.gate_up_proj.weight"]
        out[f"{q}.mlp.dense_4h_to_h.weight"] = sd[f"{p}.mlp.down_proj.weight"]
    d = c.head_dim
    out["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (
        10000 ** (torch.arange(0, d // 2, 2, dtype=torch.float32) / (d // 2)))
    theta = c.rope_parameters["rope_theta"]
    cfg = {"architectures": ["ChatGLMModel"], "model_type": "chatglm",
           "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                        "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
                        "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
           "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size,
           "num_attention_heads": c.num_attention_heads, "kv_channels": d,
           "multi_query_attention": c.num_key_value_heads != c.num_attention_heads,
           "multi_query_group_num": c.num_key_value_heads, "ffn_hidden_size": c.intermediate_size,
           "padded_vocab_size": c.vocab_size, "seq_length": c.max_position_embeddings,
           "add_qkv_bias": True, "add_bias_linear": False, "rmsnorm": True,
           "layernorm_epsilon": c.rms_norm_eps, "apply_residual_connection_post_layernorm": False,
           "post_layer_norm": True, "original_rope": True, "rope_ratio": theta / 10000.0,
           "apply_query_key_layer_scaling": True, "attention_softmax_in_fp32": True,
           "fp32_residual_connection": False, "hidden_dropout": 0.0, "attention_dropout": 0.0,
           "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}
    return _write(path, cfg, out)
