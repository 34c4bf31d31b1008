"""Default sampling settings from a checkpoint's generation_config.json, as vLLM's
`--generation-config`: model authors tune temperature, top_p and friends there, and users
moving from vLLM expect a request that leaves them out to get those values, not ours.

"auto" reads the model directory's file (a .gguf file or a missing file gives none),
"vllm" ignores it, and any other value names a folder holding one.
"""

from __future__ import annotations

import json
import os
from typing import Any

# generation_config.json's name -> SamplingParams' name.
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FILE = "generation_config.json"


def checkpoint_folder(model: str) -> str | None:
    """The folder whose generation_config.json "auto" reads: the model's directory (also
    one holding a .gguf), the folder of a config.json given alone; None for a .gguf file."""
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return path
    if os.path.isfile(path) and path.endswith(".json"):
        return os.path.dirname(os.path.abspath(path))
    return None


def default_sampling_overrides(setting: str, model: str) -> dict[str, Any]:
    """The SamplingParams fields the generation config sets (by SamplingParams' names),
    for the model argument `model` (a path, as EngineConfig.model).
    Raises ValueError for a folder that has no readable generation_config.json (named by
    the user, so a typo must not pass silently) or a value of the wrong type."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        folder = checkpoint_folder(model)
        if folder is None or not os.path.isfile(os.path.join(folder, FILE)):
            return {}
    else:
        folder = setting
        if not os.path.isfile(os.path.join(folder, FILE)):
            raise ValueError(f"generation_config: no {FILE} in {setting!r} (give 'auto', "
                             "'vllm' or a folder holding one)")
    path = os.path.join(folder, FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {path} is not a JSON object")
    out: dict[str, Any] = {}
    for name, target in FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        integral = target in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else int | float):
            raise ValueError(f"generation_config: {name} in {path} must be "
                             f"{'an integer' if integral else 'a number'}, got {value!r}")
        out[target] = value
    return out


def describe_overrides(overrides: dict[str, Any], setting: str) -> str:
    """One log line for start-up: which defaults were taken, and from where."""
    if not overrides:
        return f"default sampling settings: pagedllm's own (--generation-config {setting})"
    shown = ", ".join(f"{k}={v}" for k, v in overrides.items())
    return (f"default sampling settings from generation_config.json (--generation-config "
            f"{setting}): {shown}; requests that set a field keep their own value")
