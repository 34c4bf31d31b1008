"""Remote-code checkpoints (InternLM, InternLM2/3, Baichuan, Qwen v1, ChatGLM2/3) served by
the one Llama decoder, without running the checkpoint's own Python.

transformers cannot build these configs without `trust_remote_code`, so config.json is
read as a plain dict and translated into a `LlamaConfig` carrying the decoder's switches
(`qkv_bias`, `alibi`, `rotary_interleaved`, ...). The checkpoint's tensors are renamed
(and fused tensors split) into Llama names on the fly, then loaded as a Llama checkpoint.
Layouts: the project's format notes (sections 3-6).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from pagedllm.model_executor.models.llama import LlamaForCausalLM

Weights = Iterable[tuple[str, torch.Tensor]]


def _llama_config(raw: dict, arch: str, **kw):
    from transformers import LlamaConfig

    switches = {k: kw.pop(k) for k in ("qkv_bias", "alibi", "rotary_interleaved", "norm_head",
                                       "partial_rotary_factor") if k in kw}
    kw.setdefault("tie_word_embeddings", bool(raw.get("tie_word_embeddings", False)))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if raw.get(key) is not None:
            kw.setdefault(key, raw[key])
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype is None and (raw.get("bf16") or raw.get("fp16")):  # Qwen v1 spelling
        dtype = "bfloat16" if raw.get("bf16") else "float16"
    cfg = LlamaConfig(architectures=[arch], dtype=dtype, hidden_act="silu", **kw)
    for k, v in switches.items():
        setattr(cfg, k, v)
    cfg.remote_code_family = REMOTE_CODE_FAMILY[arch]
    return cfg


def _rope(raw_theta: float, scaling: dict | None) -> dict:
    out: dict = {"rope_theta": float(raw_theta)}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("linear", "dynamic"):
            raise ValueError(f"unsupported rope scaling {scaling!r}")
        out["rope_scaling"] = {"rope_type": kind, "factor": float(scaling["factor"])}
    return out


def _internlm2_config(raw: dict, arch: str):
    return _llama_config(
        raw, arch,
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        attention_bias=bool(raw.get("bias", False)),
        **_rope(raw.get("rope_theta", 10000.0), raw.get("rope_scaling")),
    )


def _internlm_config(raw: dict, arch: str):
    rotary = raw.get("rotary") or {}  # some revisions: {"base": ..., "type": "dynamic", ...}
    scaling = raw.get("rope_scaling")
    if rotary.get("type") == "dynamic" and rotary.get("scaling_factor", 1.0) != 1.0:
        scaling = {"type": "dynamic", "factor": rotary["scaling_factor"]}
    return _llama_config(
        raw, arch,
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        attention_bias=bool(raw.get("bias", True)),
        **_rope(rotary.get("base", raw.get("rope_theta", 10000.0)), scaling),
    )


def _internlm3_config(raw: dict, arch: str):
    # Llama names; `qkv_bias` biases q/k/v, `bias` o_proj and the MLP. transformers'
    # InternLM3Config maps them onto Llama's attention_bias / mlp_bias and so requires them
    # equal: the same restriction here.
    qkv_bias, bias = bool(raw.get("qkv_bias", False)), bool(raw.get("bias", False))
    if qkv_bias != bias:
        raise ValueError(f"InternLM3 with qkv_bias={qkv_bias} but bias={bias} is not supported")
    heads = raw["num_attention_heads"]
    return _llama_config(
        raw, arch,
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 32768),
        attention_bias=bias, mlp_bias=bias,
        **_rope(raw.get("rope_theta", 10000.0), raw.get("rope_scaling")),
    )


def _baichuan_config(raw: dict, arch: str):
    hidden = raw["hidden_size"]
    # The published configs carry no flag for either: like vLLM, 7B (hidden 4096) uses RoPE
    # and 13B ALiBi; Baichuan2 (vocab 125696) has the NormHead. Explicit `alibi` /
    # `norm_head` keys in config.json override the guess.
    alibi = raw.get("alibi", arch == "BaichuanForCausalLM" and hidden != 4096)
    norm_head = raw.get("norm_head", raw["vocab_size"] == 125696)
    return _llama_config(
        raw, arch,
        hidden_size=hidden, intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings") or raw.get("model_max_length") or 4096,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        alibi=bool(alibi), norm_head=bool(norm_head),
    )


def _qwen_config(raw: dict, arch: str):
    heads = raw["num_attention_heads"]
    inter2 = raw.get("intermediate_size") or raw["ffn_hidden_size"]
    return _llama_config(
        raw, arch,
        hidden_size=raw["hidden_size"], intermediate_size=inter2 // 2,
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        head_dim=raw.get("kv_channels") or raw["hidden_size"] // heads,
        vocab_size=raw.get("vocab_size") or raw["padded_vocab_size"],
        rms_norm_eps=raw.get("layer_norm_epsilon", 1e-6),
        # use_logn_attn / use_dynamic_ntk only act beyond seq_length: cap the context there.
        max_position_embeddings=raw.get("seq_length", 2048),
        rope_theta=float(raw.get("rotary_emb_base", 10000.0)),
        partial_rotary_factor=float(raw.get("rotary_pct", 1.0)),
        qkv_bias=True,
    )


def _chatglm_config(raw: dict, arch: str):
    if ("ffn_hidden_size" not in raw or not raw.get("rmsnorm", True)
            or raw.get("apply_residual_connection_post_layernorm")):
        raise ValueError("ChatGLM checkpoints with LayerNorm or post-norm residuals (ChatGLM-6B v1) "
                         "are not supported; ChatGLM2/3 and GLM-4 are")
    if raw.get("add_bias_linear") and not raw.get("add_qkv_bias", True):
        raise ValueError("ChatGLM with add_bias_linear but no add_qkv_bias is not supported")
    heads = raw["num_attention_heads"]
    kv = raw.get("multi_query_group_num", heads) if raw.get("multi_query_attention") else heads
    bias_linear = bool(raw.get("add_bias_linear", False))
    return _llama_config(
        raw, arch,
        hidden_size=raw["hidden_size"], intermediate_size=raw["ffn_hidden_size"],
        num_hidden_layers=raw["num_layers"], num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=raw.get("kv_channels") or raw["hidden_size"] // heads,
        vocab_size=raw["padded_vocab_size"], rms_norm_eps=raw.get("layernorm_epsilon", 1e-5),
        max_position_embeddings=raw.get("seq_length", 8192),
        rope_theta=10000.0 * float(raw.get("rope_ratio", 1.0)),
        attention_bias=bias_linear, mlp_bias=bias_linear,
        qkv_bias=bool(raw.get("add_qkv_bias", False)),
        # THUDM rotates the first half of each head, in interleaved pairs
        partial_rotary_factor=0.5, rotary_interleaved=True,
    )


# ---------------------------------------------------------------- weight renaming
def _split_rows(name: str, tensor: torch.Tensor, parts: list[tuple[str, int]]) -> Iterator:
    """Split a fused tensor's rows; `name` holds `{}` where each part's name goes."""
    for part, chunk in zip(parts, tensor.split([n for _, n in parts], dim=0), strict=True):
        yield name.format(part[0]), chunk


def _qkv_names(prefix: str, suffix: str) -> str:
    return f"{prefix}.self_attn.{{}}_proj.{suffix}"


def _internlm2_weights(cfg, weights: Weights) -> Iterator:
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r = nh // nkv
    simple = {"attention.wo": "self_attn.o_proj", "attention_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm", "feed_forward.w1": "mlp.gate_proj",
              "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
    for name, t in weights:
        if name == "model.tok_embeddings.weight":
            yield "model.embed_tokens.weight", t
        elif name == "output.weight":
            yield "lm_head.weight", t
        elif m := re.match(r"(model\.layers\.\d+)\.attention\.wqkv\.(weight|bias)$", name):
            # rows grouped per kv head: [nkv, r q-heads + k + v, d]
            g = t.reshape(nkv, r + 2, d, *t.shape[1:])
            rest = t.shape[1:]
            yield _qkv_names(m[1], m[2]).format("q"), g[:, :r].reshape(nh * d, *rest)
            yield _qkv_names(m[1], m[2]).format("k"), g[:, r].reshape(nkv * d, *rest)
            yield _qkv_names(m[1], m[2]).format("v"), g[:, r + 1].reshape(nkv * d, *rest)
        elif m := re.match(r"(model\.layers\.\d+)\.(.+)\.(weight|bias)$", name):
            if m[2] not in simple:
                raise ValueError(f"unexpected InternLM2 tensor {name!r}")
            yield f"{m[1]}.{simple[m[2]]}.{m[3]}", t
        else:
            yield name, t


def _baichuan_weights(cfg, weights: Weights) -> Iterator:
    h = cfg.hidden_size
    for name, t in weights:
        if m := re.match(r"(model\.layers\.\d+)\.self_attn\.W_pack\.(weight|bias)$", name):
            yield from _split_rows(_qkv_names(m[1], m[2]), t, [("q", h), ("k", h), ("v", h)])
        elif name == "lm_head.weight" and cfg.norm_head:
            # Baichuan2's NormHead normalises each row at inference: do it once here.
            yield name, F.normalize(t.float(), dim=-1, eps=1e-12).to(t.dtype)
        else:
            yield name, t


def _qwen_weights(cfg, weights: Weights) -> Iterator:
    h = cfg.num_attention_heads * cfg.head_dim
    simple = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
              "attn.c_proj": "self_attn.o_proj", "mlp.w2": "mlp.gate_proj",
              "mlp.w1": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
    for name, t in weights:
        if name == "transformer.wte.weight":
            yield "model.embed_tokens.weight", t
        elif name == "transformer.ln_f.weight":
            yield "model.norm.weight", t
        elif m := re.match(r"transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)$", name):
            yield from _split_rows(_qkv_names(f"model.layers.{m[1]}", m[2]), t,
                                   [("q", h), ("k", h), ("v", h)])
        elif m := re.match(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$", name):
            if m[2] not in simple:
                raise ValueError(f"unexpected Qwen tensor {name!r}")
            yield f"model.layers.{m[1]}.{simple[m[2]]}.{m[3]}", t
        else:
            yield name, t


def _chatglm_weights(cfg, weights: Weights) -> Iterator:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    simple = {"input_layernorm": "input_layernorm",
              "post_attention_layernorm": "post_attention_layernorm",
              "self_attention.dense": "self_attn.o_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}
    pre = "transformer.encoder.layers."
    for name, t in weights:
        if name.endswith("rotary_pos_emb.inv_freq"):
            continue
        if name == "transformer.embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", t
        elif name == "transformer.encoder.final_layernorm.weight":
            yield "model.norm.weight", t
        elif name == "transformer.output_layer.weight":
            yield "lm_head.weight", t
        elif m := re.match(re.escape(pre) + r"(\d+)\.(.+)\.(weight|bias)$", name):
            layer, mod, kind = f"model.layers.{m[1]}", m[2], m[3]
            if mod == "self_attention.query_key_value":
                yield from _split_rows(_qkv_names(layer, kind), t, [("q", q), ("k", kv), ("v", kv)])
            elif mod == "mlp.dense_h_to_4h":  # [gate | up], silu(gate) * up
                yield from _split_rows(f"{layer}.mlp.{{}}_proj.{kind}", t,
                                       [("gate", inter), ("up", inter)])
            elif mod in simple:
                yield f"{layer}.{simple[mod]}.{kind}", t
            else:
                raise ValueError(f"unexpected ChatGLM tensor {name!r}")
        else:
            yield name, t


def _same(cfg, weights: Weights) -> Iterator:
    yield from weights


# architecture -> family; family -> (config builder, weight renamer)
REMOTE_CODE_FAMILY = {
    "InternLMForCausalLM": "internlm",
    "InternLM2ForCausalLM": "internlm2",
    "InternLM3ForCausalLM": "internlm3",
    "BaiChuanForCausalLM": "baichuan",
    "BaichuanForCausalLM": "baichuan",
    "QWenLMHeadModel": "qwen",
    "ChatGLMModel": "chatglm",
    "ChatGLMForConditionalGeneration": "chatglm",
}
_FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "internlm": (_internlm_config, _same),
    "internlm2": (_internlm2_config, _internlm2_weights),
    "internlm3": (_internlm3_config, _same),
    "baichuan": (_baichuan_config, _baichuan_weights),
    "qwen": (_qwen_config, _qwen_weights),
    "chatglm": (_chatglm_config, _chatglm_weights),
}


def remote_code_architecture(raw: dict) -> str | None:
    for arch in raw.get("architectures") or []:
        if arch in REMOTE_CODE_FAMILY:
            return arch
    return None


def remote_code_config(raw: dict):
    """config.json (as a dict) of a remote-code checkpoint -> a LlamaConfig with switches."""
    arch = remote_code_architecture(raw)
    if arch is None:
        raise ValueError(f"not a remote-code architecture: {raw.get('architectures')}")
    if raw.get("quantization_config"):
        raise ValueError(f"quantized {arch} checkpoints are not supported (float weights only)")
    return _FAMILIES[REMOTE_CODE_FAMILY[arch]][0](raw, arch)


class RemoteCodeForCausalLM(LlamaForCausalLM):
    """A remote-code checkpoint: the Llama decoder, loaded through the family's renamer."""

    def __init__(self, config, architecture: str, max_positions: int, backend, quant=None):
        super().__init__(config, architecture, max_positions, backend, quant)
        self.config = config

    def load_weights(self, weights) -> None:
        rename = _FAMILIES[self.config.remote_code_family][1]
        super().load_weights(rename(self.config, weights))
