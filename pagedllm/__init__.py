"""pagedllm: serve open-source LLMs fast with a paged KV cache and continuous batching.

The public names are loaded on first use (PEP 562), not here: importing any submodule runs
this file first, and the pure-Python parts (`pagedllm.core`, `pagedllm.config`,
`pagedllm.sampling_params`) must stay importable without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "LLM": "pagedllm.entrypoints.llm",
    "ModelEngine": "pagedllm.entrypoints.llm",
    "EngineConfig": "pagedllm.config",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "LoRARequest": "pagedllm.lora_request",
    "RequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling_params",
    "SamplingParams": "pagedllm.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "Logprob",
    "LoRARequest",
    "ModelEngine",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.llm import LLM, ModelEngine
    from pagedllm.lora_request import LoRARequest
    from pagedllm.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
