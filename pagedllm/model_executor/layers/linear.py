"""The linear layers: one family, a parallel style times a weight method.

The parallel style says which block of the checkpoint's [out, in] weight a rank holds, the
Megatron split chosen so that one decoder layer needs two all-reduces and nothing else:
q/k/v and gate/up are column-parallel (each rank computes its own heads and its own slice
of the intermediate activations, with no communication), o_proj and down_proj are
row-parallel (each rank multiplies its input slice; the partial sums are all-reduced),
small layers every rank needs whole (the MoE router) are replicated. Fused layers (qkv,
gate_up) hold several checkpoint tensors ("shards") side by side along the output, each
split on its own so that every rank's slice stays fused.

The weight method (layers/weight_method.py) says how the block is stored and multiplied:
dense float, GPTQ/AWQ packed integers, GGUF Q4_0/Q8_0 blocks, FP8 e4m3 with scales. It is
chosen from the checkpoint's QuantConfig by `weight_method_for`, so the model code builds
every linear the same way and never asks which format it holds. At world size 1 every style is plain
x @ W.T + b, so a model has one code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.distributed import all_gather, all_reduce, divide, get_tp_rank, get_tp_world_size
from pagedllm.model_executor.layers.quantization.config import QuantConfig
from pagedllm.model_executor.layers.quantization.fp8 import Fp8Method
from pagedllm.model_executor.layers.quantization.gguf import GGUFPackedMethod
from pagedllm.model_executor.layers.quantization.gptq_awq import PackedMethod
from pagedllm.model_executor.layers.sharding import (
    ShardedWeights,
    check_shape,
    copy_block,
    head_partition,
    read_block,
)
from pagedllm.model_executor.layers.weight_method import (
    DenseMethod,
    WeightMethod,
    frozen_param,
    piece,
)

# QuantConfig.method -> the weight method that stores it (None: a float checkpoint)
_WEIGHT_METHODS: dict[str, type[PackedMethod] | type[Fp8Method]] = {
    "gptq": PackedMethod,
    "awq": PackedMethod,
    "gguf": GGUFPackedMethod,
    "fp8": Fp8Method,
}


def weight_method_for(quant: QuantConfig | None) -> WeightMethod:
    """A fresh weight method for one layer of a checkpoint quantized as `quant`."""
    if quant is None:
        return DenseMethod()
    if quant.method not in _WEIGHT_METHODS:  # mxfp4: gpt-oss experts, read by that model
        raise ValueError(f"{quant.method} checkpoints are supported for gpt-oss only (its MoE experts)")
    return _WEIGHT_METHODS[quant.method](quant)


@dataclass
class ShardLayout:
    """The block of the checkpoint's weight one rank holds.

    `parts` maps a shard name (None: an unfused layer) to (rows in the checkpoint tensor,
    first row this rank keeps, rows it keeps); the rank keeps input columns [in_start,
    in_start + in_features) of `full_in`. `reduce`: the rank's products are partial sums
    over its input slice, all-reduced (row-parallel over more than one rank)."""

    full_in: int
    in_start: int
    in_features: int
    parts: dict[str | None, tuple[int, int, int]]
    reduce: bool = False
    shards: dict[str | None, tuple[int, int]] = field(init=False)  # shard -> (local start, rows)
    out_features: int = field(init=False)

    def __post_init__(self) -> None:
        self.shards, start = {}, 0
        for name, (_, _, n) in self.parts.items():
            self.shards[name] = (start, n)
            start += n
        self.out_features = start


class LinearBase(ShardedWeights, nn.Module):
    """A linear layer: its rank's block (`layout`), a weight method holding and multiplying
    it, and an optional bias. The bias is the layer's own (every format stores it in
    float), split with the output rows; under row parallelism it is added once, after the
    all-reduce. `quant` is the format the layer was built for (None: float)."""

    def __init__(self, layout: ShardLayout, bias: bool, quant: QuantConfig | None):
        super().__init__()
        self.layout = layout
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.quant = quant
        self.method = weight_method_for(quant)
        self.method.create(self)
        self.register_parameter("bias", frozen_param(torch.empty(layout.out_features)) if bias else None)
        self._bias_loaded: set[str | None] = set()

    def takes_fp8_rows(self, rows: int | None = None) -> bool:
        """Whether forward may be given an Fp8Rows (activations the layer before quantized
        per token) instead of a float tensor: see quantization/fp8_rows.py. `rows`: the
        input's row count where the caller knows it (a few rows may take another product)."""
        return self.method.takes_fp8_rows(self, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.reduce:  # sum the ranks' partial products, add the bias once
            y = all_reduce(self.method.apply(self, x, None))
            return y if self.bias is None else y + self.bias
        return self.method.apply(self, x, self.bias)

    # ------------------------------------------------------------------ loading
    def load_shard(self, param_name: str, shard: str | None, tensor) -> None:
        if shard not in self.layout.parts:
            raise ValueError(f"unknown shard {shard!r}")
        if param_name == "bias":
            self._load_bias(shard, tensor)
        else:
            self.method.load(self, param_name, shard, tensor)

    def _load_bias(self, shard: str | None, tensor) -> None:
        if self.bias is None:
            if self.method.accepts_zero_bias and not torch.count_nonzero(read_block(tensor)):
                return  # e.g. the zero biases some GPTQ exports carry: harmless
            raise ValueError("checkpoint has a non-zero bias for a linear layer built without one")
        full, src, n = self.layout.parts[shard]
        start, _ = self.layout.shards[shard]
        what = piece("bias", shard)
        check_shape(what, tensor, (full,))
        copy_block(what, self.bias.data[start:start + n], read_block(tensor, slice(src, src + n)))
        self._bias_loaded.add(shard)

    def missing(self) -> list[str]:
        missing = self.method.missing(self)
        if self.bias is not None:
            missing += [piece("bias", s) for s in self.layout.shards if s not in self._bias_loaded]
        return missing

    @torch.no_grad()
    def finish_loading(self) -> None:
        if missing := self.missing():
            raise ValueError(f"{self.method.name} linear layer is incomplete: missing {missing}")
        self.method.finish(self)

    @torch.no_grad()
    def fill_random(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Random weights (load_format='dummy'): about N(0, std), bias zero. `generator`
        lives on the layer's device."""
        self.method.fill_random(self, generator, std)
        if self.bias is not None:
            self.bias.data.zero_()
            self._bias_loaded = set(self.layout.shards)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out, in] this rank's block computes with."""
        return self.method.dequantized_weight(self, dtype)

    def extra_repr(self) -> str:
        lay = self.layout
        split = f", input {lay.in_start}+{lay.in_features} of {lay.full_in}" if lay.reduce else ""
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"{self.method.describe(self)}{split}")


class ColumnParallelLinear(LinearBase):
    """Output rows split over ranks: by default each shard into equal contiguous slices;
    `parts` (shard -> (first row, rows)) chooses another split, e.g. by heads. With
    `gather_output` every rank ends with the whole output (a quantized LM head)."""

    def __init__(self, in_features: int, out: int | dict[str | None, int], bias: bool,
                 quant: QuantConfig | None = None, *, parts: dict[str | None, tuple[int, int]] | None = None,
                 gather_output: bool = False):
        rank, world = get_tp_rank(), get_tp_world_size()
        sizes = out if isinstance(out, dict) else {None: out}
        split: dict[str | None, tuple[int, int, int]] = {}
        for name, size in sizes.items():
            if parts is not None:
                src, n = parts[name]
            else:
                n = divide(size, world, f"output size of {name or 'the layer'}")
                src = rank * n
            split[name] = (size, src, n)
        super().__init__(ShardLayout(in_features, 0, in_features, split), bias, quant)
        self.gather_output = gather_output

    @classmethod
    def qkv(cls, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
            quant: QuantConfig | None = None) -> ColumnParallelLinear:
        """Fused q/k/v split by heads: each rank gets its query heads and the KV heads
        they attend with (replicated when there are fewer KV heads than ranks)."""
        rank, world = get_tp_rank(), get_tp_world_size()
        q0, nq = head_partition(num_heads, rank, world, "num_attention_heads")
        k0, nk = head_partition(num_kv_heads, rank, world, "num_key_value_heads", replicate=True)
        kv = (k0 * head_dim, nk * head_dim)
        return cls(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
                   bias, quant, parts={"q": (q0 * head_dim, nq * head_dim), "k": kv, "v": kv})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_gather(y, dim=-1) if self.gather_output and get_tp_world_size() > 1 else y


class RowParallelLinear(LinearBase):
    """Input columns split over ranks (the input is already split: the layer before was
    column-parallel); partial products are summed with one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None):
        world = get_tp_world_size()
        local = divide(in_features, world, "input size of a row-parallel layer")
        layout = ShardLayout(in_features, get_tp_rank() * local, local, {None: (out_features, 0, out_features)},
                             reduce=world > 1)
        super().__init__(layout, bias, quant)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (small layers every rank needs whole, such as the
    MoE router, whose output must agree across ranks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: QuantConfig | None = None):
        super().__init__(ShardLayout(in_features, 0, in_features, {None: (out_features, 0, out_features)}),
                         bias, quant)
