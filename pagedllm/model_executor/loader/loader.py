"""Build the model a ModelSource points at (pagedllm.model_source), with its weights."""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.model_executor.layers.linear import LinearBase
from pagedllm.model_executor.layers.quantization import resolve_quant_config
from pagedllm.model_executor.layers.rotary import RotaryEmbedding
from pagedllm.model_executor.loader.gguf_file import gguf_config, gguf_quant_config, gguf_weights
from pagedllm.model_executor.models import resolve_architecture
from pagedllm.model_executor.models.language_model import language_model_config
from pagedllm.model_executor.models.remote_code import remote_code_architecture, remote_code_config

# resolve_source is re-exported: the engine imports it from here.
from pagedllm.model_source import ModelSource, resolve_source  # noqa: F401

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0  # seconds between load progress lines (the last file always logs)


def load_hf_config(source: ModelSource):
    if source.kind == "gguf":
        return gguf_config(source.path)
    # Remote-code architectures (InternLM2, Baichuan, Qwen v1, ChatGLM, ...): AutoConfig
    # would need trust_remote_code, so the file is read as data and translated instead.
    cfg_path = os.path.join(source.path, "config.json")
    raw: dict = {}
    if os.path.exists(cfg_path):
        import json

        with open(cfg_path) as f:
            raw = json.load(f)
        if remote_code_architecture(raw):
            return remote_code_config(raw)
    from transformers import AutoConfig

    try:
        return language_model_config(AutoConfig.from_pretrained(source.path))
    except ValueError as e:  # e.g. an unknown remote-code model_type
        if raw.get("auto_map") or raw.get("architectures"):
            from types import SimpleNamespace

            resolve_architecture(SimpleNamespace(architectures=raw.get("architectures")))
        raise e


class LoadProgress:
    """Log lines while checkpoint files are read, so that a 15-75 s load is not silent:
    one line at the start (files, GiB), then one when a file is done if PROGRESS_EVERY_S
    have passed since the last line, and always at the last file. Costs a stat per file."""

    def __init__(self, files: list[str]):
        self.files = files
        self.sizes = [os.path.getsize(f) for f in files]
        self.total = sum(self.sizes)
        self.done = 0
        self.done_bytes = 0
        self.t0 = self.last = time.monotonic()
        logger.info("loading weights: %d file%s, %.1f GiB, from %s", len(files),
                    "" if len(files) == 1 else "s", self.total / 2**30,
                    os.path.dirname(files[0]) if files else "?")

    def file_done(self) -> None:
        self.done_bytes += self.sizes[self.done]
        self.done += 1
        now = time.monotonic()
        if self.done == len(self.files) or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            logger.info("loading weights: %d/%d files, %.1f/%.1f GiB, %.0f s", self.done,
                        len(self.files), self.done_bytes / 2**30, self.total / 2**30, now - self.t0)


def _hf_weights(source: ModelSource, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) pairs. With `lazy`, safetensors entries come as lazy
    slices (`safe_open(...).get_slice`): each layer reads only the block its rank keeps
    (sharding.read_block), so under tensor parallelism no rank reads a whole sharded
    tensor. A slice is only valid until the next pair is drawn (its file may close).
    .bin/.pt files are memory-mapped, which defers the reads in the same way. Progress is
    logged per file (LoadProgress)."""
    if source.load_format == "safetensors":
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
        progress = LoadProgress(files)
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, (st.get_slice(name) if lazy else st.get_tensor(name))
            progress.file_done()
    else:
        files = sorted(glob.glob(os.path.join(source.path, "*.bin")) + glob.glob(os.path.join(source.path, "*.pt")))
        progress = LoadProgress(files)
        for f in files:
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            progress.file_done()


def _dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights with sane activations: matrices ~N(0, 0.02), norms 1, biases 0.
    Linear layers fill themselves through their weight method (packed ones with random
    words that dequantize to the same spread)."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        # Drawn on the parameter's device: a 7B model's worth of CPU randn takes a minute.
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    linear = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    # Other modules that store packed weights fill themselves too (gpt-oss MXFP4 experts).
    own = {n: m for n, m in model.named_modules() if hasattr(m, "fill_random") and n not in linear}
    with torch.no_grad():
        for m in linear.values():
            m.fill_random(generator(next(m.parameters()).device))
            m.finish_loading()
        for m in own.values():
            m.fill_random(generator(next(m.parameters()).device))
        for name, p in model.named_parameters():
            if name.rpartition(".")[0] in linear or name.rpartition(".")[0] in own:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator(p.device))


def load_model(source: ModelSource, hf_config, max_positions: int, backend, device: torch.device,
               dtype: torch.dtype, seed: int = 0, quantization: str | None = None) -> torch.nn.Module:
    """`quantization` is the user's setting: None detects it from the checkpoint; a value
    that contradicts the checkpoint is an error (see resolve_quant_config)."""
    arch, cls = resolve_architecture(hf_config)
    quant = resolve_quant_config(quantization, source.kind, source.load_format, source.path, hf_config)
    if quant is not None and quant.method == "mxfp4" and device.type != "cuda":
        quant = None  # no kernel computes from packed MXFP4 here: the experts are dequantized at load
    if source.kind == "gguf" and source.load_format == "gguf":
        # Q4_0/Q8_0 linear layers stay packed where a kernel computes from them (CUDA).
        quant = gguf_quant_config(source.path, device)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built on the meta device and materialised uninitialised: every parameter is
        # overwritten by the checkpoint (load_weights checks none is missing), so random
        # initialisation would only cost seconds.
        with torch.device("meta"):
            model = cls(hf_config, arch, max_positions, backend, **({"quant": quant} if quant else {}))
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device)
    for module in model.modules():  # every rope table (Gemma 3 has a local and a global one)
        if isinstance(module, RotaryEmbedding):
            module.build_tables(device)
    if source.load_format == "dummy":
        _dummy_weights(model, seed)
    elif source.kind == "gguf":
        model.load_weights(gguf_weights(source.path, hf_config, quant))
    else:
        # The remote-code renamers (models/remote_code.py) reshape and split whole fused tensors,
        # so those checkpoints are read whole; every other model's layers cut their own
        # slice out of a lazy one.
        model.load_weights(_hf_weights(source, lazy=getattr(hf_config, "remote_code_family", None) is None))
    return model.eval()
