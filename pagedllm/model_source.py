"""What a `model` argument points at, and in which format.

Accepted: a Hugging Face checkpoint directory (config.json + *.safetensors or *.bin), a
GGUF file, a Hugging Face Hub id `org/name` (from the local cache, else downloaded; see
pagedllm.hub), or, with load_format="dummy", a directory or config.json alone (random weights
of that architecture, for benchmarks).

Plain data with no torch, so that the tokenizer and the executors can name a model without
importing the loader that builds it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from pagedllm.hub import looks_like_hub_id, resolve_hub_model


@dataclass
class ModelSource:
    path: str
    kind: str  # "hf" | "gguf"
    load_format: str  # "safetensors" | "pt" | "gguf" | "dummy"


def resolve_source(model: str, load_format: str = "auto", revision: str | None = None,
                   download_dir: str | None = None, config_only: bool = False) -> ModelSource:
    """Where `model` is on disk and in which format. A hub id becomes its snapshot
    directory (`revision` and `download_dir` apply to hub ids only), so that everything
    after this reads one local layout. `config_only` (pagedllm plan): a hub id needs only
    its config files, and a snapshot without weights is read as load_format "dummy"."""
    path = os.path.expanduser(model)
    if looks_like_hub_id(model):
        path = resolve_hub_model(model, revision, download_dir, weights=not config_only)
        if config_only and load_format == "auto" and not any(
                n.endswith((".safetensors", ".bin", ".pt", ".gguf")) for n in os.listdir(path)):
            load_format = "dummy"
    elif not os.path.exists(path):
        raise FileNotFoundError(
            f"model {model!r} not found: give a local Hugging Face checkpoint directory, a "
            ".gguf file or a Hugging Face Hub id (org/name)"
        )
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path, "gguf", "dummy" if load_format == "dummy" else "gguf")
    if os.path.isfile(path) and path.endswith(".json"):
        if load_format != "dummy":
            raise ValueError("a config.json alone needs load_format='dummy' (random weights)")
        return ModelSource(os.path.dirname(os.path.abspath(path)), "hf", "dummy")
    if not os.path.isdir(path):
        raise ValueError(f"{model!r} is neither a checkpoint directory nor a .gguf file")
    if load_format == "auto":
        if glob.glob(os.path.join(path, "*.safetensors")):
            load_format = "safetensors"
        elif glob.glob(os.path.join(path, "*.bin")) or glob.glob(os.path.join(path, "*.pt")):
            load_format = "pt"
        elif ggufs := sorted(glob.glob(os.path.join(path, "*.gguf"))):
            return ModelSource(ggufs[0], "gguf", "gguf")
        else:
            raise ValueError(f"no weights (*.safetensors, *.bin, *.gguf) in {path!r}")
    return ModelSource(path, "hf", load_format)
