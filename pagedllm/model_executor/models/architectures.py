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
    router_bias: bool = False  # the router (gpt-oss `mlp.router`) has a bias
    expert_bias: bool = False  # each expert's gate/up and down projections have biases
    # "silu": silu(gate) * up; "clamped_swiglu" (gpt-oss): gate clamped above and up on both
    # sides at the config's `swiglu_limit`, then gate * sigmoid(alpha * gate) * (up + 1)
    # with alpha the config's `swiglu_alpha`.
    activation: str = "silu"


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
    # A learned logit per head that joins every softmax's denominator (gpt-oss `sinks`).
    attention_sinks: bool = False
    moe: MoeSpec | None = None
    # Gemma: RMSNorm scales by (1 + weight), in float32 before the cast back; the token
    # embeddings are multiplied by sqrt(hidden_size) in the activations' dtype.
    gemma_norm: bool = False
    embed_scale: bool = False
    # Checkpoint name fragments -> ours, the first match only (so renames may swap names):
    # Gemma's four norms around attention and MLP onto the sandwich-norm modules.
    renames: tuple[tuple[str, str], ...] = ()
    # Checkpoint name prefixes -> ours, the first match only: a multimodal wrapper's
    # language model onto the decoder's names.
    prefixes: tuple[tuple[str, str], ...] = ()
    # Checkpoint tensors of parts not served (a vision tower), skipped by name prefix.
    ignore_prefixes: tuple[str, ...] = ()
    # q/k/v and gate/up stored fused in the checkpoint ([q | k | v] rows, [gate | up] rows,
    # Phi-3), cut into our fused layers' shards at load.
    fused_checkpoint: bool = False
    # Multi-head latent attention and DeepSeek routing (models/deepseek.py): the config's
    # MLA ranks, expert counts and routing method say the rest.
    mla: bool = False


LLAMA = ArchSpec()
_GLM = ArchSpec(attention_bias_on_o=False, rotary_interleaved=True)
_QWEN_MOE = MoeSpec("num_experts", "moe_intermediate_size", renormalise=None, weights_in_fp32=False)

# Gemma 2/3 checkpoints name the norm after attention `post_attention_layernorm` and the
# one before the MLP `pre_feedforward_layernorm`; the decoder's sandwich norms are named as
# GLM-4's (`post_self_attn_layernorm`, `post_attention_layernorm`, `post_mlp_layernorm`).
_GEMMA_NORMS = ((".post_attention_layernorm.", ".post_self_attn_layernorm."),
                (".pre_feedforward_layernorm.", ".post_attention_layernorm."),
                (".post_feedforward_layernorm.", ".post_mlp_layernorm."))
_GEMMA2 = ArchSpec(sandwich_norm=True, gemma_norm=True, embed_scale=True, renames=_GEMMA_NORMS)
_GEMMA3 = ArchSpec(sandwich_norm=True, gemma_norm=True, embed_scale=True, qk_norm=True, renames=_GEMMA_NORMS)
# Gemma3ForConditionalGeneration: the language model only. transformers < 4.52 and the
# published checkpoints write `language_model.model.*`, later versions `model.language_model.*`.
_GEMMA3_MM = ArchSpec(
    sandwich_norm=True, gemma_norm=True, embed_scale=True, qk_norm=True,
    renames=_GEMMA_NORMS,
    prefixes=(("language_model.model.", "model."), ("model.language_model.", "model."),
              ("language_model.lm_head.", "lm_head.")),
    ignore_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector."))

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
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3_MM,
    "Phi3ForCausalLM": ArchSpec(fused_checkpoint=True),
    # rope on interleaved pairs (V3: unless the config's rope_interleave says otherwise)
    "DeepseekV2ForCausalLM": ArchSpec(mla=True, rotary_interleaved=True),
    "DeepseekV3ForCausalLM": ArchSpec(mla=True, rotary_interleaved=True),
    # top-k of the logits then a softmax over those k: the same as a softmax, top-k and
    # renormalising, which is how the MoE block routes
    "GptOssForCausalLM": ArchSpec(attention_sinks=True, moe=MoeSpec(
        "num_local_experts", "intermediate_size", renormalise=True, weights_in_fp32=False,
        router_bias=True, expert_bias=True, activation="clamped_swiglu")),
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
