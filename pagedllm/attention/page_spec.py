"""What one token costs in the page pool, as the model's attention layers declare it.

The pool is `num_blocks` blocks of `block_size` tokens per layer; what one token of one
layer holds differs by attention kind: K and V of every KV head (multi-head and grouped
attention), or one compressed latent shared by all heads (DeepSeek's multi-head latent
attention, MLA). Each attention layer says which (`page_spec`); the model runner sizes
and lays out the pool from it, `pagedllm plan` prices it, and the block manager
(core/) only ever counts blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PageSpec:
    """One layer's pages: `parts` tensors (2: K and V; 1: an MLA latent), each holding
    `token_shape` elements per token."""

    parts: int
    token_shape: tuple[int, ...]
    kind: str = "kv"  # what the pages hold, in words for logs and `plan`

    @classmethod
    def full_kv(cls, num_kv_heads: int, head_dim: int) -> PageSpec:
        return cls(2, (num_kv_heads, head_dim), "kv")

    @classmethod
    def latent(cls, width: int) -> PageSpec:
        """One vector per token shared by every head (MLA: kv_lora_rank + rope dims)."""
        return cls(1, (width,), "mla-latent")

    @property
    def elements_per_token(self) -> int:
        return self.parts * math.prod(self.token_shape)

    def bytes_per_token(self, num_layers: int, elem_bytes: int) -> int:
        """Every layer's pages for one token."""
        return num_layers * self.elements_per_token * elem_bytes

    def head_major(self, wanted: bool) -> bool:
        """Whether the pool is laid out head-major (see pool_shape): only K/V pages have heads."""
        return wanted and self.kind == "kv" and len(self.token_shape) == 2

    def pool_shape(self, num_layers: int, num_blocks: int, block_size: int,
                   head_major: bool = False) -> tuple[int, ...]:
        """The one tensor that holds the whole pool: [layers, parts, blocks, block_size,
        *token_shape]; head-major, [layers, parts, blocks, kv_heads, block_size, head_dim]
        (each KV head's rows of a page contiguous, what a decode program reads)."""
        if self.head_major(head_major):
            heads, dim = self.token_shape
            return (num_layers, self.parts, num_blocks, heads, block_size, dim)
        return (num_layers, self.parts, num_blocks, block_size, *self.token_shape)

    def layer_views(self, cache, num_layers: int, head_major: bool = False) -> list[tuple]:
        """Each layer's parts as [blocks, block_size, *token_shape] tensors, whatever the
        pool's layout: a head-major pool's are transposed views, which the kernels read
        and write through their strides."""
        if self.head_major(head_major):
            return [tuple(cache[i, p].transpose(1, 2) for p in range(self.parts)) for i in range(num_layers)]
        return [tuple(cache[i, p] for p in range(self.parts)) for i in range(num_layers)]

    def describe(self) -> str:
        """e.g. `K and V [8 x 128] per layer`, `mla-latent [576] per layer`."""
        shape = " x ".join(str(n) for n in self.token_shape)
        what = "K and V" if self.kind == "kv" and self.parts == 2 else self.kind
        return f"{what} [{shape}] per layer"

def common_page_spec(specs: Iterable[PageSpec]) -> PageSpec:
    """The spec every attention layer of a model shares (one pool tensor serves all)."""
    found = set(specs)
    if len(found) != 1:
        raise ValueError(f"attention layers disagree on their page layout: {sorted(map(str, found))}")
    return found.pop()
