"""RMSNorm, computed in float32 like the reference implementations (one fused kernel on CUDA).

Gemma's variant (`gemma=True`) stores w and scales by (1 + w), in float32 before the cast
back to the activations' dtype (Llama casts first, then scales): the checkpoint's weights
stay as published and the rounding matches transformers' Gemma RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_executor.layers import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: bool = False):
        """With `residual`, adds it first and returns (normed, new residual): the fused
        pattern every pre-norm decoder layer uses. `quant` (CUDA, 2-D x; the caller checks
        that the next layer takes it): the normed rows come as an Fp8Rows."""
        if fused_ops.available(x):
            y = fused_ops.rms_norm(x, self.weight, self.eps, residual, gemma=self.gemma, quant=quant)
            return y if residual is None else (y, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            h = (h * (1.0 + self.weight.float())).to(dtype)
        else:
            h = self.weight * h.to(dtype)
        return h if residual is None else (h, residual)
