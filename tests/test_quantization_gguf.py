"""GGUF quant types load correctly: a tiny random Llama written as a llama.cpp GGUF (q/k
rows permuted as llama.cpp's converter does) in each type, loaded by pagedllm, matches
Hugging Face transformers holding the file's dequantized weights.

`gguf.quants.quantize` covers the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and BF16; it
cannot quantize K-quants, so those files hold random but valid K-quant blocks (random bit
fields, sane fp16 super-block scales), which exercises the same load path.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import save_tiny_model
from quant_packers import assert_parity, prompts, reference_model, write_gguf

from pagedllm import LLM

gguf = pytest.importorskip("gguf")

# Rows must hold whole 256-value K-quant blocks: hidden 256, MLP 512.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("gguf_src")), "llama", **SHAPE)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS)
def test_gguf_quant_type_matches_hf(hf_llama, tmp_path, qtype):
    path = str(tmp_path / f"tiny-{qtype}.gguf")
    ref = reference_model(hf_llama, write_gguf(hf_llama, path, qtype))
    if qtype in QUANTIZABLE:  # really quantized, not a copy of the float weights
        w = hf_llama.model.layers[0].mlp.down_proj.weight
        assert not torch.equal(ref.model.layers[0].mlp.down_proj.weight, w)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    assert_parity(llm, ref, prompts(2, seed=5), max_new=6)


def test_gguf_rejects_gptq_setting(hf_llama, tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(hf_llama, path, "Q8_0")
    LLM(model=path, quantization="gguf", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="GGUF"):
        LLM(model=path, quantization="gptq", skip_tokenizer_init=True, num_kv_blocks=16)
