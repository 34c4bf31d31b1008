"""Pooling a step's hidden states into embedding vectors.

A pooling request's prompt may be read over several steps (chunked prefill), so each
chunk contributes a partial vector: mean pooling the sum of its rows, CLS the row of
position 0, last-token the row of the prompt's last position. The worker keeps the
partial sums between chunks and finishes a vector at the prompt's last chunk. All chunks
of a step are reduced with one index_add over the rows they select.
"""

from __future__ import annotations

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
            if kind == "MEAN":
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


def finish(vectors: torch.Tensor, params: list[PoolingParams], divisors: list[int]) -> list[torch.Tensor]:
    """Finished vectors: divided (the mean), cut to `dimensions`, normalized if asked. Rows
    with the same settings are handled together (in a batch of embeddings, all are)."""
    div = torch.tensor(divisors, dtype=torch.float32).to(vectors.device, non_blocking=True)
    vectors = vectors / div.unsqueeze(1)
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
