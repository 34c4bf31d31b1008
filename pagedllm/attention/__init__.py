"""Attention backends over the paged KV cache; the torch one is the reference."""

from __future__ import annotations

import os

import torch

from pagedllm.attention.metadata import AttentionMetadata, long_decode
from pagedllm.attention.torch_backend import TorchPagedAttention

__all__ = ["AttentionMetadata", "TorchPagedAttention", "get_attention_backend", "long_decode"]


def get_attention_backend(device: torch.device, batch_invariant: bool = False):
    """Triton kernels on CUDA when Triton is installed, the torch reference otherwise.
    PAGEDLLM_ATTENTION_BACKEND=torch|triton forces one; =flashinfer takes prefills through
    FlashInfer's paged prefill and decodes through Triton (attention/flashinfer_backend.py;
    CUDA and flashinfer-python needed). The batch-invariant mode has a backend of its own
    (attention/batch_invariant.py)."""
    if batch_invariant:
        if device.type == "cuda":
            try:
                from pagedllm.attention.triton_backend import TritonInvariantAttention
            except ImportError:
                pass
            else:
                return TritonInvariantAttention
        from pagedllm.attention.batch_invariant import BatchInvariantAttention

        return BatchInvariantAttention
    choice = os.environ.get("PAGEDLLM_ATTENTION_BACKEND", "auto")
    if choice not in ("auto", "torch", "triton", "flashinfer"):
        raise ValueError(f"PAGEDLLM_ATTENTION_BACKEND must be auto|torch|triton|flashinfer, got {choice!r}")
    if choice == "flashinfer":
        from pagedllm.attention.flashinfer_backend import (
            FlashInferPrefillAttention,
            flashinfer_available,
        )

        if device.type != "cuda" or not flashinfer_available():
            raise ValueError("PAGEDLLM_ATTENTION_BACKEND=flashinfer needs a CUDA device and "
                             "flashinfer-python (pip install flashinfer-python)")
        return FlashInferPrefillAttention
    want_triton = choice == "triton" or (choice == "auto" and device.type == "cuda")
    if want_triton:
        try:
            from pagedllm.attention.triton_backend import TritonPagedAttention
        except ImportError:
            if choice == "triton":
                raise
        else:
            return TritonPagedAttention
    return TorchPagedAttention
