"""PEFT LoRA adapter folders: `adapter_config.json` + `adapter_model.safetensors`.

Two readers over one parse. `inspect_adapter` reads the config and the safetensors
header only (no tensor data), so the front end can refuse a bad adapter (missing file,
rank above `max_lora_rank`, modules no LoRA layer serves, PEFT features not served) with
a ValueError before anything is queued; `load_adapter` then reads the tensors, in the
worker, once per adapter (the worker keeps a CPU copy, see worker/lora_manager.py).

The scale of each module (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA, per
module under `rank_pattern` / `alpha_pattern`) is returned with its tensors; the layers
fold it into B.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections a LoRA layer serves, by their Hugging Face names (models fuse q/k/v and
# gate/up; an adapter's tensors for them are placed side by side to match).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


@dataclass
class AdapterModule:
    """One adapted projection: its tensors' names, rank and scale."""

    name: str  # the module in HF naming, e.g. model.layers.0.self_attn.q_proj
    a_key: str
    b_key: str
    rank: int
    scale: float


@dataclass
class AdapterInfo:
    path: str
    rank: int  # the largest rank of any module
    modules: dict[str, AdapterModule] = field(default_factory=dict)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the
    module's name (a regex, as PEFT reads it)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r}: no such directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is missing")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} is missing "
                         "(only safetensors adapters are served)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read {CONFIG_FILE} ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {peft_type!r} is not LoRA")
    unserved = {"use_dora": bool(cfg.get("use_dora")), "modules_to_save": bool(cfg.get("modules_to_save")),
                "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
                "bias": cfg.get("bias", "none") not in (None, "none")}
    if any(unserved.values()):
        raise ValueError(f"LoRA adapter {path!r}: {[k for k, v in unserved.items() if v]} "
                         "not supported (plain LoRA on q/k/v/o/gate/up/down only)")
    return cfg


def inspect_adapter(path: str, max_rank: int) -> AdapterInfo:
    """Check an adapter folder without reading its tensors; ValueError names the problem."""
    from safetensors import safe_open

    cfg = _read_config(path)
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    rslora = bool(cfg.get("use_rslora", False))
    pairs: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    others: list[str] = []
    try:
        with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    others.append(key)
                else:
                    pairs.setdefault(m["module"], {})[m["ab"]] = (key, tuple(f.get_slice(key).get_shape()))
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_FILE} ({type(e).__name__}: {e})") from None
    for module in sorted(pairs):
        short = module.rsplit(".", 1)[-1]
        if short not in LORA_TARGETS:
            raise ValueError(f"LoRA adapter {path!r}: target module {short!r} ({module}) is not "
                             f"one this model serves LoRA on ({', '.join(LORA_TARGETS)})")
    if others:
        raise ValueError(f"LoRA adapter {path!r}: tensor {others[0]!r} is not a LoRA A/B weight "
                         "(embeddings, biases and saved modules are not served)")
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    info = AdapterInfo(path, 0)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        (a_key, a_shape), (b_key, b_shape) = ab["A"], ab["B"]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: {module} has A {a_shape} and B {b_shape}, "
                             "which do not make a low-rank pair")
        r = a_shape[0]
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {r} of {module} exceeds max_lora_rank "
                             f"{max_rank} (raise --max-lora-rank)")
        a = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha))
        scale = a / math.sqrt(r) if rslora else a / r
        info.modules[module] = AdapterModule(module, a_key, b_key, r, scale)
        info.rank = max(info.rank, r)
    return info


def load_adapter(path: str, max_rank: int) -> tuple[AdapterInfo, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's info and, per module (HF naming), its (A [r, in], B [out, r]) on the CPU."""
    from safetensors.torch import load_file

    info = inspect_adapter(path, max_rank)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE), device="cpu")
    return info, {m.name: (tensors[m.a_key], tensors[m.b_key]) for m in info.modules.values()}
