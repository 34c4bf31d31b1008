"""Random PEFT LoRA adapters for tiny HF models, written with PEFT itself: the reference
that multi-LoRA serving is checked against."""

from __future__ import annotations

import copy
import json
import os

import torch

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, path: str, seed: int, r: int = 8, alpha: float = 16,
                 targets: list[str] | None = None, rslora: bool = False, std: float = 0.1,
                 **config):
    """Save a random non-zero adapter for `base` (a HF model, left untouched) at `path`;
    return the HF model with the adapter applied (PEFT's own layers), for reference.
    `config`: more LoraConfig fields (rank_pattern, alpha_pattern, ...)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_LINEAR, lora_dropout=0.0,
                     use_rslora=rslora, init_lora_weights=False, **config)
    model = get_peft_model(copy.deepcopy(base), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(path)
    return model.base_model.model.eval()


def set_rank_in_config(path: str, **fields) -> None:
    """Rewrite fields of a saved adapter's adapter_config.json."""
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
