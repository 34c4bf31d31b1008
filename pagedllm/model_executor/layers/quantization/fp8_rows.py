"""Activations already quantized per token for an FP8 linear layer.

The layer before an FP8 product (RMSNorm, SiLU-and-mul) may write its output as e4m3
values and per-token scales instead of bf16 (fused_ops, `quant=True`), when the layer
after it says it takes them (`LinearBase.takes_fp8_rows`): the product then starts from
these, and the bf16 activations are never written and read back for quantizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Fp8Rows:
    q: torch.Tensor  # e4m3 [rows, K]
    scale: torch.Tensor  # float32 [rows, 1]: row i is q[i] * scale[i]
    dtype: torch.dtype  # the activations' own dtype: the layer's output comes back in it

    FP8 = torch.float8_e4m3fn

    @property
    def shape(self) -> torch.Size:
        return self.q.shape
