"""How one embedding request wants its vector made, and the model's default way.

A pooling request reads its prompt and returns one vector instead of generating: the
hidden states of the last layer (after the final norm) pooled over the prompt's tokens.
`PoolingParams` travels with the request to the engine core as plain data; the worker
pools. `PoolerConfig` is what the checkpoint says (sentence-transformers' `modules.json`
and `1_Pooling/config.json`, the Matryoshka declarations of `config.json`) and fills in
what a request leaves out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN", "CLS", "MAX", "MEAN_SQRT_LEN")

# sentence-transformers' 1_Pooling/config.json keys, by the pooling they select.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS", "pooling_mode_max_tokens": "MAX",
             "pooling_mode_mean_sqrt_len_tokens": "MEAN_SQRT_LEN"}

# sentence-transformers >= 6 writes `"pooling_mode": "<name>"` instead of the flags above.
_ST_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS", "max": "MAX",
                  "mean_sqrt_len_tokens": "MEAN_SQRT_LEN"}


def _st_module(m, name: str) -> bool:
    """Whether a modules.json entry is sentence-transformers' module `name` (Pooling, Dense,
    Normalize), as `sentence_transformers.models.<name>` (most published checkpoints) or
    by its newer class paths (`sentence_transformers.base.modules.dense.Dense`, ...)."""
    kind = str(m.get("type", "")) if isinstance(m, dict) else ""
    return kind.startswith("sentence_transformers.") and kind.rsplit(".", 1)[-1] == name


@dataclass
class PoolingParams:
    """`dimensions`: keep the first this many components (Matryoshka), before normalizing;
    None keeps them all."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")

    @property
    def needs_every_position(self) -> bool:
        """Every pooling but the last token's reads positions a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"


@dataclass
class PoolerConfig:
    """The model's pooling: sentence-transformers' when its files are there, else the
    last token, normalized (how decoder embedding models such as Qwen3-Embedding pool)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    hidden_size: int | None = None
    # Matryoshka: None = the model declares none (a request's `dimensions` is refused);
    # an empty tuple = any size up to hidden_size; else only these sizes.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # sentence-transformers' Dense modules after the pooling (their folders, in order): the
    # worker applies them (layers/pooler.py); the last one's width is the vector's.
    dense: tuple[str, ...] = ()

    @classmethod
    def from_model(cls, model_path: str, hf_config) -> PoolerConfig:
        hidden = getattr(hf_config, "hidden_size", None)
        matryoshka = None
        dims = getattr(hf_config, "matryoshka_dimensions", None)
        if dims:
            matryoshka = tuple(int(d) for d in dims)
        elif getattr(hf_config, "is_matryoshka", False):
            matryoshka = ()
        config = cls(hidden_size=hidden, matryoshka_dimensions=matryoshka)
        modules = st_modules(model_path)
        if modules is None:
            return config
        pooling_dir = next((m.get("path") for m in modules if _st_module(m, "Pooling")), None)
        config.normalize = any(_st_module(m, "Normalize") for m in modules)
        config.dense = dense_folders(model_path, modules)
        if config.dense:
            last = _read_json(config.dense[-1], "config.json") or {}
            config.hidden_size = int(last.get("out_features", hidden or 0)) or hidden
        pooling = _read_json(model_path, os.path.join(pooling_dir, "config.json")) if pooling_dir else None
        if isinstance(pooling, dict):
            chosen = [kind for key, kind in _ST_MODES.items() if pooling.get(key)]
            others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v
                      and k not in _ST_MODES]
            mode = pooling.get("pooling_mode")  # sentence-transformers >= 6: one key
            if mode is not None:
                modes = [mode] if isinstance(mode, str) else list(mode)
                chosen += [_ST_MODE_NAMES[m] for m in modes if m in _ST_MODE_NAMES]
                others += [m for m in modes if m not in _ST_MODE_NAMES]
            if len(chosen) != 1 or others:
                raise ValueError("1_Pooling/config.json selects a pooling this engine does not "
                                 "have: exactly one of last token, mean, CLS, max or "
                                 "mean-sqrt-len is supported")
            config.pooling_type = chosen[0]
        return config

    def params(self, dimensions: int | None = None) -> PoolingParams:
        """The PoolingParams of a request asking for `dimensions` (ValueError if the model
        cannot give that many)."""
        if dimensions is not None:
            m = self.matryoshka_dimensions
            if m is None:
                raise ValueError("dimensions: this model does not support Matryoshka "
                                 "truncation (its config declares no matryoshka dimensions)")
            if dimensions < 1 or (self.hidden_size and dimensions > self.hidden_size):
                raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")
            if m and dimensions not in m:
                raise ValueError(f"dimensions must be one of {list(m)} for this model, got "
                                 f"{dimensions}")
        return PoolingParams(self.pooling_type, self.normalize, dimensions)


def st_modules(model_path: str) -> list | None:
    """The entries of a checkpoint folder's sentence-transformers `modules.json` (None
    without one, or for a single-file checkpoint)."""
    if not os.path.isdir(model_path):
        return None
    modules = _read_json(model_path, "modules.json")
    return modules if isinstance(modules, list) else None


def dense_folders(folder: str, modules: list) -> tuple[str, ...]:
    """The folders of sentence-transformers' Dense modules listed in `modules.json`, in
    their order (each holds config.json and the layer's weights)."""
    return tuple(os.path.join(folder, m.get("path", "")) for m in modules if _st_module(m, "Dense"))


def _read_json(folder: str, name: str):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
