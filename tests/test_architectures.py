"""Architecture differences are data: every served architecture has an ArchSpec, and the
decoder's switches follow it, merged with what the checkpoint's config says."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from pagedllm.model_executor.models import MODEL_REGISTRY
from pagedllm.model_executor.models.architectures import ARCHITECTURES, arch_spec
from pagedllm.model_executor.models.llama import ModelShape
from pagedllm.model_executor.models.moe import MOE_ARCHITECTURES


def test_every_registered_architecture_has_a_spec():
    assert set(MODEL_REGISTRY) == set(ARCHITECTURES)
    assert set(MOE_ARCHITECTURES) == {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                      "GptOssForCausalLM"}
    assert MODEL_REGISTRY["GptOssForCausalLM"].__name__ == "GptOssForCausalLM"  # its expert layouts
    with pytest.raises(ValueError, match="no architecture spec"):
        arch_spec("GPT2LMHeadModel")


# (qkv_bias, o_bias, qk_norm, sandwich_norm, rotary_interleaved) with and without the
# config's attention_bias
@pytest.mark.parametrize(("arch", "with_bias", "without_bias"), [
    ("LlamaForCausalLM", (True, True, False, False, False), (False, False, False, False, False)),
    ("Qwen2ForCausalLM", (True, False, False, False, False), (True, False, False, False, False)),
    ("Qwen3ForCausalLM", (True, True, True, False, False), (False, False, True, False, False)),
    ("GlmForCausalLM", (True, False, False, False, True), (False, False, False, False, True)),
    ("Glm4ForCausalLM", (True, False, False, True, True), (False, False, False, True, True)),
    ("Qwen3MoeForCausalLM", (True, True, True, False, False), (False, False, True, False, False)),
])
def test_decoder_switches_follow_the_spec(arch, with_bias, without_bias):
    for attention_bias, expected in ((True, with_bias), (False, without_bias)):
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                          vocab_size=100, attention_bias=attention_bias)
        s = ModelShape(cfg, arch)
        assert (s.qkv_bias, s.o_bias, s.qk_norm, s.sandwich_norm, s.rotary_interleaved) == expected, attention_bias


def test_remote_code_switches_come_from_the_config():
    """The remote-code families' specs are plain: their translated configs carry the switches."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      vocab_size=100)
    cfg.qkv_bias, cfg.rotary_interleaved, cfg.alibi = True, True, True
    s = ModelShape(cfg, "ChatGLMModel")
    assert (s.qkv_bias, s.o_bias, s.rotary_interleaved, s.alibi) == (True, False, True, True)
