"""Batch-invariant numerics: a row's result does not depend on what else is in the batch.

Why a request's logits normally change with its neighbours: the fast kernels pick their
reduction order from the shape of the whole batch. A CPU float32 matmul of one row runs a
matrix-vector kernel, of 2..15 rows one blocking and of 16 or more another, each summing
the K products in its own order; cuBLAS picks split-K for small batches; an attention
kernel splits a long context by the number of sequences. Every choice is sound, but the
last bits of a token's hidden state differ, and over a few layers and a sampled token they
decide a different continuation.

This mode fixes each reduction's split independently of the batch:

- Linear layers multiply in tiles of exactly `ROW_TILE` rows (the last one padded): a
  matmul of a fixed shape runs the same kernel, and a row's result in it does not depend
  on its position or on the other rows (checked by tests/test_batch_invariant.py for the
  BLAS in use). The tiles go through one batched matmul, whose result per matrix does not
  depend on how many matrices there are.
- Attention (attention/batch_invariant.py) walks each query over keys in pages of fixed
  absolute positions with fixed-shape matmuls, so decode, a prefill chunk and a cached
  prefix compute a token identically.
- Transcendental elementwise ops (exp, SiLU) on CPU: PyTorch runs full SIMD vectors
  where it can and a scalar loop on the remainder, and the two differ in the last bit;
  where the remainder falls depends on the tensor's size and the threads' split of it.
  `elementwise` pads the flat tensor so that every element goes through the vector path.
- Row-wise ops (RMSNorm's mean, softmax, log-softmax, the sampler) already reduce each
  row alone, in an order that depends only on the row's length.

The mode is per engine: the model runner enters `enabled(True)` around its forward pass
and logits, so an engine without it beside one with it in the same process (tests) keeps
its fast kernels.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows per matmul in this mode (a multiple of every CPU kernel's row block)
_GRAIN = 32768  # PyTorch's elementwise grain: one thread runs at most this many at a time

_state = {"on": False}


def is_enabled() -> bool:
    return _state["on"]


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """The mode for the code inside (restored after, so engines do not leak into each other)."""
    before = _state["on"]
    _state["on"] = on
    try:
        yield
    finally:
        _state["on"] = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): F.linear, or in this mode the fixed-tile product."""
    if not _state["on"]:
        return F.linear(x, weight, bias)
    return tiled_linear(x, weight, bias)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed as ceil(M / ROW_TILE) products of exactly ROW_TILE rows each."""
    if x.is_cuda:
        from pagedllm.batch_invariant_cuda import matmul

        lead, k = x.shape[:-1], x.shape[-1]
        out = matmul(x.reshape(-1, k), weight)
        if bias is not None:
            out = out + bias
        return out.view(*lead, weight.shape[0])
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    tiles = max(1, -(-m // ROW_TILE))
    if tiles * ROW_TILE != m:
        x2 = F.pad(x2, (0, 0, 0, tiles * ROW_TILE - m))
    out = torch.bmm(x2.view(tiles, ROW_TILE, k), weight.t().unsqueeze(0).expand(tiles, k, n))
    out = out.view(tiles * ROW_TILE, n)[:m]
    if bias is not None:
        out = out + bias
    return out.view(*lead, n)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] for fixed-shape products: on CPU torch.bmm (its result
    for one matrix depends only on the shapes), on CUDA the fixed-tile Triton kernel
    (cuBLAS may change algorithm with the batch count)."""
    if a.is_cuda:
        from pagedllm.batch_invariant_cuda import bmm as cuda_bmm

        return cuda_bmm(a, b)
    return torch.bmm(a, b)


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a transcendental elementwise fn, every element on the SIMD path on CPU.

    PyTorch splits a flat tensor of n elements over k = min(threads, ceil(n / grain))
    threads in chunks of ceil(n / k), and each chunk runs pairs of vectors, leaving the
    remainder to the scalar loop. Padding n to a multiple of `_LANES` times every k that can
    occur makes each chunk a whole number of vector pairs, so no element is ever on the
    scalar path. (CUDA computes every element with the same instruction: nothing to do.)"""
    if not _state["on"] or x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    unit = _pad_unit(torch.get_num_threads())
    total = max(unit, -(-flat.numel() // unit) * unit)
    padded = F.pad(flat, (0, total - flat.numel()))
    return fn(padded)[: flat.numel()].view(x.shape)


_LANES = 128  # a multiple of two vectors of any CPU dtype (AVX-512 bf16: 2 x 32)


def _pad_unit(threads: int) -> int:
    """A length every possible chunking of which is whole vector pairs: _LANES times the
    lcm of 1..threads, or (many threads) whole grains for each thread."""
    lcm = 1
    for k in range(2, threads + 1):
        lcm = lcm * k // math.gcd(lcm, k)
    return _LANES * lcm if _LANES * lcm < _GRAIN * threads else _GRAIN * threads
