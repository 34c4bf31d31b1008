"""Tiny random Hugging Face models built from configs at test time: the reference."""

from __future__ import annotations

import os

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


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
    return randomize(AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval(), norm_std)


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
