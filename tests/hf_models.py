"""Tiny random Hugging Face models built from configs at test time: the reference."""

from __future__ import annotations

import os

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


# Families whose attention SDPA cannot express (Gemma 2's soft-capped scores, gpt-oss's
# sinks): some transformers releases still pick SDPA for them and then drop the cap or the
# sinks, so the reference is pinned to the eager implementation, which has both.
EAGER_ONLY = ("gemma2", "gpt_oss")


def make_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kw = dict(TINY)
    if model_type == "qwen3":
        kw["head_dim"] = 32
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def randomize(model, norm_std: float = 0.0):
    """Weights wide enough that greedy choices are far from ties (the default init leaves
    tiny logits); with `norm_std`, norm weights drawn too (around 0 for Gemma's (1 + w))."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.1)
            elif norm_std and "norm" in name:
                p.normal_(0, norm_std)
    return model


def random_tiny_model(model_type: str, seed: int = 0, norm_std: float = 0.0, **overrides):
    """A random HF model in float32 (randomize)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = make_config(model_type, **overrides)
    kw = {}
    if model_type in EAGER_ONLY:
        kw["attn_implementation"] = "eager"
    return randomize(AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **kw).eval(), norm_std)


def save_tiny_model(path: str, model_type: str, seed: int = 0, safetensors: bool = True,
                    norm_std: float = 0.0, **overrides):
    """Build a random HF model (random_tiny_model), save it (no tokenizer), return it."""
    model = random_tiny_model(model_type, seed, norm_std, **overrides)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=safetensors)
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from HF `generate`."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(prompt_ids):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, toks, strict=True)]
    return toks, lps


# DeepSeek (multi-head latent attention + DeepSeek MoE), tests/test_models_deepseek.py
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 0.707, "mscale_all_dim": 0.707}
DEEPSEEK_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=512, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
                     first_k_dense_replace=1, rope_parameters=DEEPSEEK_YARN)
DEEPSEEK_VARIANTS = {
    # DeepSeek-V2: q through its low-rank bottleneck, experts chosen within the best groups
    "v2": ("deepseek_v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                               routed_scaling_factor=1.5)),
    # DeepSeek-V2-Lite: q_proj straight from the hidden states, greedy top-k
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy")),
    # DeepSeek-V3: sigmoid scores + correction bias, grouped (noaux_tc), renormalised, scaled;
    # YaRN with mscale != mscale_all_dim (cos/sin scaled too); two dense layers
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5, first_k_dense_replace=2, num_hidden_layers=4,
                               rope_parameters={**DEEPSEEK_YARN, "mscale": 1.0})),
}
# V3 with rope on half-split (neox) pairs: on CUDA the fused in-place rotary kernel
DEEPSEEK_VARIANTS["v3-neox"] = ("deepseek_v3", dict(DEEPSEEK_VARIANTS["v3"][1], rope_interleave=False))


def save_tiny_deepseek(path: str, variant: str, seed: int = 0):
    """A random HF model in float32, weights wide enough that greedy choices are far from
    ties (experts and the V3 correction bias too), saved as save_pretrained writes it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    model_type, extra = DEEPSEEK_VARIANTS[variant]
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**DEEPSEEK_TINY, **extra})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path)
    return model
