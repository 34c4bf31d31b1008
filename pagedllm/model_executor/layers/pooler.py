"""Pooling a step's hidden states into embedding vectors.

A pooling request's prompt may be read over several steps (chunked prefill), so each
chunk contributes a partial vector: mean (and mean-sqrt-len) pooling the sum of its rows,
max pooling their elementwise maximum, CLS the row of position 0, last-token the row of
the prompt's last position. The worker keeps the partial vectors between chunks and
finishes a vector at the prompt's last chunk. All chunks of a step are reduced with one
index_add (and one index_reduce for max pooling) over the rows they select. Then
sentence-transformers' Dense modules, if the checkpoint has any, the Matryoshka cut and
the normalization.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.pooling_params import PoolingParams


@dataclass
class PoolingChunk:
    """One pooling request's rows in a step's flat batch."""

    params: PoolingParams
    first_row: int  # the chunk's first row in the batch
    start: int  # the prompt position of that row
    num_tokens: int
    num_prompt: int
    last: bool  # the chunk ends the prompt: its vector is finished


@dataclass
class PoolingPlan:
    """Rows to reduce (`rows`, with the chunk index of each in `segments`)."""

    chunks: list[PoolingChunk] = field(default_factory=list)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        rows: list[np.ndarray] = []
        segs: list[np.ndarray] = []
        for i, c in enumerate(self.chunks):
            kind = c.params.pooling_type
            if kind in ("MEAN", "MEAN_SQRT_LEN", "MAX"):
                r = np.arange(c.first_row, c.first_row + c.num_tokens)
            elif kind == "CLS":
                r = np.array([c.first_row] if c.start == 0 else [], dtype=np.int64)
            else:  # LAST
                r = np.array([c.first_row + c.num_tokens - 1] if c.last else [], dtype=np.int64)
            rows.append(r.astype(np.int64))
            segs.append(np.full(len(r), i, dtype=np.int64))
        return np.concatenate(rows), np.concatenate(segs)


def partial_sums(hidden: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor,
                 num_chunks: int) -> torch.Tensor:
    """[num_chunks, hidden] float32: each chunk's selected rows summed."""
    out = torch.zeros(num_chunks, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, segments, hidden.index_select(0, rows).float())


def partial_maxes(hidden: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor,
                  num_chunks: int) -> torch.Tensor:
    """[num_chunks, hidden] float32: each chunk's selected rows' elementwise maximum
    (-inf for a chunk with none)."""
    out = torch.full((num_chunks, hidden.shape[-1]), float("-inf"), dtype=torch.float32,
                     device=hidden.device)
    vals = hidden.index_select(0, rows).float()
    return out.scatter_reduce_(0, segments.unsqueeze(1).expand_as(vals), vals, "amax")


def divisor(params: PoolingParams, num_prompt: int) -> float:
    """What a finished chunk sum is divided by: the token count for the mean, its square
    root for mean-sqrt-len, 1 otherwise."""
    if params.pooling_type == "MEAN":
        return float(num_prompt)
    if params.pooling_type == "MEAN_SQRT_LEN":
        return math.sqrt(num_prompt)
    return 1.0


# sentence-transformers' Dense activations (config.json's `activation_function`, a class
# path): the ones its models ship with; anything else is refused at load.
_ACTIVATIONS = {"Identity": lambda x: x, "Tanh": torch.tanh, "ReLU": F.relu, "GELU": F.gelu,
                "Sigmoid": torch.sigmoid, "SiLU": F.silu}


class DenseLayer:
    """One sentence-transformers Dense module (activation(x @ W.T + b)), float32."""

    def __init__(self, folder: str, device: torch.device):
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        name = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
        if name not in _ACTIVATIONS:
            raise ValueError(f"{folder}: Dense activation {cfg.get('activation_function')!r} is not "
                             f"supported (one of {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[name]
        weights = _dense_weights(folder)
        self.weight = weights["linear.weight"].to(device, torch.float32)
        bias = weights.get("linear.bias")
        self.bias = bias.to(device, torch.float32) if bias is not None and cfg.get("bias", True) else None
        want = (int(cfg["out_features"]), int(cfg["in_features"]))
        if tuple(self.weight.shape) != want:
            raise ValueError(f"{folder}: Dense weight {tuple(self.weight.shape)}, config says {want}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(F.linear(x, self.weight, self.bias))


def _dense_weights(folder: str) -> dict[str, torch.Tensor]:
    path = os.path.join(folder, "model.safetensors")
    if os.path.exists(path):
        from safetensors.torch import load_file

        return load_file(path)
    path = os.path.join(folder, "pytorch_model.bin")
    if os.path.exists(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"{folder}: no model.safetensors or pytorch_model.bin for the Dense module")


def load_dense(folders: tuple[str, ...], device: torch.device) -> list[DenseLayer]:
    return [DenseLayer(f, device) for f in folders]


def finish(vectors: torch.Tensor, params: list[PoolingParams], divisors: list[float],
           dense: list[DenseLayer] | None = None) -> list[torch.Tensor]:
    """Finished vectors: divided (the means), through the Dense layers, cut to
    `dimensions`, normalized if asked. Rows with the same settings are handled together
    (in a batch of embeddings, all are)."""
    div = torch.tensor(divisors, dtype=torch.float32).to(vectors.device, non_blocking=True)
    vectors = vectors / div.unsqueeze(1)
    for layer in dense or ():
        vectors = layer(vectors)
    out: list[torch.Tensor | None] = [None] * len(params)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.dimensions, p.normalize), []).append(i)
    for (dims, normalize), idx in groups.items():
        v = vectors if len(idx) == len(params) else vectors[idx]
        if dims is not None:
            v = v[:, :dims]
        if normalize:
            v = F.normalize(v, p=2, dim=-1)
        for j, i in enumerate(idx):
            out[i] = v[j]
    return out
