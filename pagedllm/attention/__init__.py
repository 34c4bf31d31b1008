"""Attention backends over the paged KV cache; the torch one is the reference."""

from pagedllm.attention.metadata import AttentionMetadata, PrefillSeq
from pagedllm.attention.torch_backend import TorchPagedAttention

__all__ = ["AttentionMetadata", "PrefillSeq", "TorchPagedAttention", "get_attention_backend"]


def get_attention_backend(device) -> type:
    """Pick the fastest backend available for `device` (only the reference exists so far)."""
    return TorchPagedAttention
