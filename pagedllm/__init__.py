"""pagedllm: serve open-source LLMs fast with a paged KV cache and continuous batching."""

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.llm import LLM, ModelEngine
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "ModelEngine",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
