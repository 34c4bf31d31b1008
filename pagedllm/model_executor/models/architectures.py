"""What sets each served architecture apart, as data: one `ArchSpec` per architecture name.

The decoder (llama.py) is one parametrised implementation; it looks its architecture up
here once (ModelShape) and from then on reads switches, never names. What a single
checkpoint decides (bias flags, rope scaling, sliding windows, tied embeddings) stays in
its config and is read there; what is fixed by the architecture is written here. The
remote-code families (models/remote_code.py) are Llama-shaped: their translated configs carry
the switches that vary between their checkpoints (`qkv_bias`, `alibi`,
`rotary_interleaved`, ...), so their entries are plain.

Every name in models.MODEL_REGISTRY has an entry (tests/test_remote_code.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeSpec:
    """Where a Mixture-of-Experts config keeps its numbers, and how its router mixes.
    Shared experts, the sparse-layer step and dense-only layers are read from the config
    when present (Qwen2-MoE), so they need no switch here."""

    num_experts_key: str  # config key of the number of routed experts
    intermediate_key: str  # config key of one expert's MLP width
    # Top-k weights renormalised to sum to one: always (Mixtral) or as the config's
    # `norm_topk_prob` says (None).
    renormalise: bool | None
    # Expert outputs scaled by the float32 routing weights (Mixtral) or by weights cast to
    # the activations' dtype first (Qwen).
    weights_in_fp32: bool


@dataclass(frozen=True)
class ArchSpec:
    """Defaults are Llama's."""

    qkv_bias: bool = False  # q/k/v always carry a bias, whatever the config says (Qwen2)
    # The config's `attention_bias` also biases o_proj (Llama), or only q/k/v (Qwen2, GLM).
    attention_bias_on_o: bool = True
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3)
    # Each sublayer's output normed again before the residual add (GLM-4-0414).
    sandwich_norm: bool = False
    # Interleaved-pair rotary (GPT-J style) on `partial_rotary_factor` of the head (GLM).
    rotary_interleaved: bool = False
    moe: MoeSpec | None = None


LLAMA = ArchSpec()
_GLM = ArchSpec(attention_bias_on_o=False, rotary_interleaved=True)
_QWEN_MOE = MoeSpec("num_experts", "moe_intermediate_size", renormalise=None, weights_in_fp32=False)

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, attention_bias_on_o=False),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    "LlamaModel": LLAMA,
    "Qwen2Model": ArchSpec(qkv_bias=True, attention_bias_on_o=False),
    "Qwen3Model": ArchSpec(qk_norm=True),
    "GlmForCausalLM": _GLM,
    "Glm4ForCausalLM": ArchSpec(attention_bias_on_o=False, rotary_interleaved=True, sandwich_norm=True),
    "MixtralForCausalLM": ArchSpec(moe=MoeSpec("num_local_experts", "intermediate_size", renormalise=True,
                                               weights_in_fp32=True)),
    "Qwen2MoeForCausalLM": ArchSpec(moe=_QWEN_MOE),
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, moe=_QWEN_MOE),
    # remote-code checkpoints (models/remote_code.py): switches come with the translated config
    "InternLMForCausalLM": LLAMA,
    "InternLM2ForCausalLM": LLAMA,
    "InternLM3ForCausalLM": LLAMA,
    "BaiChuanForCausalLM": LLAMA,
    "BaichuanForCausalLM": LLAMA,
    "QWenLMHeadModel": LLAMA,
    "ChatGLMModel": LLAMA,
    "ChatGLMForConditionalGeneration": LLAMA,
}


def arch_spec(architecture: str) -> ArchSpec:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"no architecture spec for {architecture!r}") from None
