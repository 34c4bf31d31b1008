"""Host-side arrays shared by the model runner and the draft model's runner: where a
step's tokens sit in the page pool, and the zeroed pool tensor itself."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch


def chunk_arrays(starts: np.ndarray, lens: np.ndarray, q_start: np.ndarray, tables: np.ndarray,
                 block_size: int) -> dict[str, np.ndarray]:
    """Positions and cache slots of every token of a step's chunks (`lens[i]` tokens of
    sequence i from position `starts[i]`, rows from `q_start[i]`), with the per-sequence
    arrays the attention metadata is built from; numpy, no per-token Python."""
    total = int(lens.sum())
    seq_of_row = np.repeat(np.arange(len(lens)), lens)
    positions = np.arange(total, dtype=np.int64) - np.repeat(q_start - starts, lens)
    slots = tables[seq_of_row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return {"positions": positions, "slots": slots, "q_start": q_start, "q_len": lens,
            "ctx_len": starts + lens, "tables": tables}


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zeroed KV tensor. Zeros matter: attention masks unused slots, but 0 * NaN from
    stale memory would still poison a row. On CPU the memory is an anonymous mapping
    (returned: it must outlive the tensor), which the kernel zero-fills page by page on
    first touch, so a large pool costs nothing at start-up (an eager torch.zeros of 2 GiB
    spends seconds in page faults)."""
    if device.type == "cpu":
        buf = mmap.mmap(-1, math.prod(shape) * (torch.finfo(dtype).bits // 8))
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape), buf
    return torch.zeros(shape, dtype=dtype, device=device), None


def page_pool(spec, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
              device: torch.device, backend) -> tuple[torch.Tensor, mmap.mmap | None, list[tuple]]:
    """A model's page pool (spec: its PageSpec) laid out as the attention backend reads it
    (head-major where it says HEAD_MAJOR_PAGES), zeroed: the pool tensor, its CPU mapping
    (see zeroed_kv_tensor) and each layer's parts as [blocks, block_size, *token_shape]."""
    head_major = getattr(backend, "HEAD_MAJOR_PAGES", False)
    cache, buf = zeroed_kv_tensor(spec.pool_shape(num_layers, num_blocks, block_size, head_major), dtype, device)
    return cache, buf, spec.layer_views(cache, num_layers, head_major)
