"""Architecture name (as in config.json) -> model class."""

from __future__ import annotations

from pagedllm.model_executor.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def resolve_architecture(config) -> tuple[str, type]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture {archs or '(none in config)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
