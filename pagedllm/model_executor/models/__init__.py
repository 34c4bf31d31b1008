"""Architecture name (as in config.json) -> model class."""

from __future__ import annotations

from pagedllm.model_executor.models.deepseek import DeepseekForCausalLM
from pagedllm.model_executor.models.glm import GlmForCausalLM
from pagedllm.model_executor.models.gpt_oss import GptOssForCausalLM
from pagedllm.model_executor.models.llama import LlamaForCausalLM
from pagedllm.model_executor.models.moe import MOE_ARCHITECTURES, MoeForCausalLM
from pagedllm.model_executor.models.remote_code import REMOTE_CODE_FAMILY, RemoteCodeForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # Base models without a head, as embedding checkpoints name themselves
    # (sentence-transformers saves Qwen3-Embedding-style models so): the same decoder.
    "LlamaModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": GlmForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForConditionalGeneration": LlamaForCausalLM,  # the language model only
    "Phi3ForCausalLM": LlamaForCausalLM,
    **{arch: MoeForCausalLM for arch in MOE_ARCHITECTURES},
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,  # multi-head latent attention + MoE
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,  # the MoE decoder, with its expert layouts
    # remote-code checkpoints, read without running their code (models/remote_code.py)
    **{arch: RemoteCodeForCausalLM for arch in REMOTE_CODE_FAMILY},
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
