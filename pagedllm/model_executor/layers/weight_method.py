"""Weight methods: how one linear layer's weight is stored, loaded and multiplied.

A linear layer (layers/linear.py) decides *which* block of the checkpoint's [out, in]
weight its rank holds and whether partial products are summed over ranks; its weight
method decides *how* that block lives in memory. The method registers the layer's
parameters for the block (`create`), fills them from full checkpoint tensors, cutting out
the block itself (`load`, so packed layouts are sharded along their packed axes), checks
and prepares them once loading is over (`finish`), and computes x @ W.T (`apply`).

One class per storage format: `DenseMethod` here; GPTQ/AWQ, GGUF-packed and FP8 in
layers/quantization/. A new format is one more subclass and one entry in
linear.weight_method_for; LoRA is a method that
wraps another one and adds the adapters' low-rank product to its `apply`. Each layer owns
its method instance, so per-layer state that is not a parameter (what has been loaded,
caches, kernel layout choices) lives on the method; parameters always live on the layer,
under the checkpoint's names, so state dicts and weight-memory counts see them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm import batch_invariant
from pagedllm.model_executor.layers import skinny_gemm
from pagedllm.model_executor.layers.sharding import check_shape, copy_block, read_block

if TYPE_CHECKING:
    from pagedllm.model_executor.layers.linear import LinearBase


def frozen_param(t: torch.Tensor) -> nn.Parameter:
    """Inference weights: parameters (so they move with the model and are counted) that
    never need a gradient."""
    return nn.Parameter(t, requires_grad=False)


def piece(name: str, shard: str | None) -> str:
    """How a missing checkpoint tensor is named in errors: `weight#q` for a fused shard."""
    return name if shard is None else f"{name}#{shard}"


class WeightMethod:
    """Interface of a weight method (see the module docstring); one instance per layer."""

    name = "abstract"
    # Some GPTQ exports carry all-zero biases that the float model lacks; a method that
    # reads such checkpoints accepts them (and still refuses a non-zero one).
    accepts_zero_bias = False

    def create(self, layer: LinearBase) -> None:
        """Register the layer's parameters for its block (`layer.layout`), uninitialised."""
        raise NotImplementedError

    def load(self, layer: LinearBase, param_name: str, shard: str | None, tensor) -> None:
        """Take one full checkpoint tensor (`<module>.<param_name>`, of fused shard
        `shard`): a torch tensor or a lazy safetensors slice, of which only the layer's
        block is read."""
        raise NotImplementedError

    def missing(self, layer: LinearBase) -> list[str]:
        """The checkpoint tensors this method still waits for."""
        raise NotImplementedError

    def finish(self, layer: LinearBase) -> None:
        """Once everything is loaded: reorder, re-pack or cache for the device's forward."""

    def fill_random(self, layer: LinearBase, generator: torch.Generator, std: float) -> None:
        """Random weights of about N(0, std) for load_format='dummy' (a generator on the
        layer's device)."""
        raise NotImplementedError

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T (+ bias) for this rank's block."""
        raise NotImplementedError

    def dequantized_weight(self, layer: LinearBase, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float [out, in] weight the layer computes with (tests and fallbacks)."""
        raise NotImplementedError

    def takes_fp8_rows(self, layer: LinearBase, rows: int | None = None) -> bool:
        """Whether `apply` takes activations quantized per token (an Fp8Rows) right now:
        only FP8 products do; a wrapper (LoRA) that also reads the float input does not."""
        return False

    def describe(self, layer: LinearBase) -> str:
        return self.name


class DenseMethod(WeightMethod):
    """A float weight [out, in] in the model's dtype, multiplied by F.linear."""

    name = "dense"

    def __init__(self) -> None:
        self._loaded: set[str | None] = set()  # shards whose rows are in

    def create(self, layer: LinearBase) -> None:
        layout = layer.layout
        layer.weight = frozen_param(torch.empty(layout.out_features, layout.in_features))

    def load(self, layer: LinearBase, param_name: str, shard: str | None, tensor) -> None:
        if param_name != "weight":
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in a float linear layer")
        layout = layer.layout
        full, src, n = layout.parts[shard]
        start, _ = layout.shards[shard]
        k0, k = layout.in_start, layout.in_features
        what = piece("weight", shard)
        check_shape(what, tensor, (full, layout.full_in))
        copy_block(what, layer.weight.data[start:start + n], read_block(tensor, slice(src, src + n), slice(k0, k0 + k)))
        self._loaded.add(shard)

    def adopt(self, layer: LinearBase, weight: torch.Tensor) -> None:
        """Take over a layer whose whole float weight is already built (a packed layer that
        the checkpoint left unquantized, see PackedMethod.finish)."""
        layer.weight = frozen_param(weight)
        self._loaded = set(layer.layout.shards)

    def missing(self, layer: LinearBase) -> list[str]:
        return [piece("weight", s) for s in layer.layout.shards if s not in self._loaded]

    def fill_random(self, layer: LinearBase, generator: torch.Generator, std: float) -> None:
        layer.weight.data.normal_(0.0, std, generator=generator)
        self._loaded = set(layer.layout.shards)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # a decode step of a few rows: one latency-minded pass over the weight (skinny_gemm)
        if not batch_invariant.is_enabled() and skinny_gemm.applies(x, layer.weight):
            return skinny_gemm.skinny_linear(x, layer.weight, bias)
        return batch_invariant.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: LinearBase, dtype: torch.dtype | None = None) -> torch.Tensor:
        return layer.weight if dtype is None else layer.weight.to(dtype)

