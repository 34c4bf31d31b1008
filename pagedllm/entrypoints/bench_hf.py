"""The Hugging Face transformers baseline: the same requests through `generate` in static
batches, as the project's benchmark notes measure it.

How it counts, and why:
- Requests go in dataset order, `batch_size` at a time, left-padded with an attention mask.
- Each batch runs `min_new_tokens = max_new_tokens =` the longest output of the batch, so
  that EOS cannot end a request early (the `ignore_eos` of the engine). With mixed output
  lengths a request may thus generate more than it asked for; only its own `output_len`
  counts as output tokens, since a static batch cannot retire it earlier: that waste is
  the cost of static batching, and `generated_tokens` in the result shows it.
- `static_cache` uses `cache_implementation="static"`, sized once for the whole workload
  so that every batch reuses the same shapes; transformers then compiles the decode step
  with torch.compile on CUDA (not on CPU). The warm-up runs each batch size once, so
  compilation falls outside the timed run.
- Weights: the same checkpoint as the engine (a GGUF file is dequantized by transformers);
  with load_format="dummy" the model is built with `from_config` and transformers' own
  random init (seeded, but not the engine's values): only shapes decide speed.
"""

from __future__ import annotations

import gc
import os
import time
from typing import TYPE_CHECKING

import torch

from pagedllm.entrypoints.bench_workloads import RandomDataset
from pagedllm.model_source import resolve_source

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  seed: int = 0) -> PreTrainedModel:
    """The engine's checkpoint as a transformers model, in eval mode on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_source(model, load_format)
    gguf: dict = {}
    path = source.path
    if source.kind == "gguf":
        path, name = os.path.split(source.path)
        gguf = {"gguf_file": name}
    if source.load_format == "dummy":
        config = AutoConfig.from_pretrained(path, **gguf)
        torch.manual_seed(seed)
        with torch.device(device):  # initialise in place: a 7B init on CPU takes minutes
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **gguf)
    return hf.to(device).eval()


class HFBackend:
    """Runs a `RandomDataset` through `model.generate` in static batches."""

    name = "hf"

    def __init__(self, model: PreTrainedModel, batch_size: int, static_cache: bool = False,
                 temperature: float = 1.0, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"hf batch size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self.static_cache = static_cache
        self.temperature = temperature
        self.seed = seed
        cfg = model.config
        pad = getattr(cfg, "pad_token_id", None)
        if pad is None:
            eos = getattr(cfg, "eos_token_id", None)
            pad = eos[0] if isinstance(eos, list | tuple) else eos
        self.pad_token_id = int(pad) if pad is not None else 0
        self.max_cache_len: int | None = None
        self.num_prompts: int | None = None
        self.generated_tokens = 0  # of the last run, padding waste included

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def compiled(self) -> bool:
        """Whether transformers auto-compiles the decode step (static cache on CUDA)."""
        return self.static_cache and self.device.type == "cuda"

    def size_cache(self, data: RandomDataset) -> None:
        """Fix the static cache length to the workload's longest request, so every batch
        (warm-up included) shares one cache shape and one compiled graph; remember the
        workload's size so the warm-up covers the last, smaller batch too."""
        self.max_cache_len = max(len(p) for p in data.prompts) + max(data.output_lens)
        self.num_prompts = len(data)

    def _batch(self, prompts: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends at the same column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        kwargs: dict = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                        "pad_token_id": self.pad_token_id}
        if self.temperature > 0:
            kwargs.update(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if self.static_cache:
            kwargs.update(cache_implementation="static", max_cache_len=self.max_cache_len)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device),
                                      attention_mask=mask.to(self.device), **kwargs)
        generated = out.shape[1] - width
        if generated != new_tokens:
            raise RuntimeError(f"HF generated {generated} tokens per row, expected {new_tokens}")
        return generated * len(prompts)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warmup(self, data: RandomDataset) -> None:
        """Untimed: one batch of each size the timed run uses (compiles each graph once)."""
        n = self.num_prompts or len(data)
        sizes = {min(self.batch_size, n)} | ({n % self.batch_size} - {0})
        for size in sorted(sizes, reverse=True):
            self._batch(data.prompts[:size], max(data.output_lens))
        self._sync()

    def run(self, data: RandomDataset) -> float:
        """Seconds for the whole workload, batch after batch."""
        torch.manual_seed(self.seed)
        generated = 0
        self._sync()
        start = time.perf_counter()
        for lo in range(0, len(data), self.batch_size):
            hi = lo + self.batch_size
            generated += self._batch(data.prompts[lo:hi], max(data.output_lens[lo:hi]))
        self._sync()
        elapsed = time.perf_counter() - start
        self.generated_tokens = generated
        return elapsed

    def info(self) -> dict:
        return {"dtype": str(self.model.dtype).replace("torch.", ""),
                "batch_size": self.batch_size, "static_cache": self.static_cache,
                "compiled": self.compiled, "generated_tokens": self.generated_tokens}

    def close(self) -> None:
        device = self.device
        del self.model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
