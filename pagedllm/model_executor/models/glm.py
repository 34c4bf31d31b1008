"""transformers' `GlmForCausalLM` (GLM-4-9B "-hf" checkpoints) and `Glm4ForCausalLM`
(GLM-4-0414), loaded as the Llama decoder.

The math is ChatGLM's (models/remote_code.py): interleaved-pair rotary on the first
`partial_rotary_factor` of each head, GQA, bias on q/k/v but not on o_proj, silu(gate) * up.
Their entries in models/architectures.py switch these on, Glm4's two extra norms
included. What is left here is the checkpoint's fused `mlp.gate_up_proj` ([gate | up]
rows), split so that the loader fills our gate/up shards as for any Llama.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from pagedllm.model_executor.layers.sharding import shape_of
from pagedllm.model_executor.models.llama import LlamaForCausalLM

_GATE_UP = re.compile(r"(.+\.mlp)\.gate_up_proj\.(weight|bias)$")


def split_gate_up(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`mlp.gate_up_proj` rows [gate | up] -> `mlp.gate_proj` and `mlp.up_proj`. `t` may be
    a lazy safetensors slice (no `.shape`, read on indexing): both index the same way."""
    for name, t in weights:
        if m := _GATE_UP.match(name):
            half = shape_of(t)[0] // 2
            yield f"{m[1]}.gate_proj.{m[2]}", t[:half]
            yield f"{m[1]}.up_proj.{m[2]}", t[half:]
        else:
            yield name, t


class GlmForCausalLM(LlamaForCausalLM):
    """Also serves Glm4ForCausalLM."""

    def __init__(self, config, architecture: str, max_positions: int, backend, quant=None):
        if quant is not None:
            # a packed gate_up_proj splits along its output columns, not its rows: untested
            raise NotImplementedError(f"quantized {architecture} checkpoints are not supported "
                                      "(float weights only)")
        super().__init__(config, architecture, max_positions, backend)

    def load_weights(self, weights) -> None:
        super().load_weights(split_gate_up(weights))
