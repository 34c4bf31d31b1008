"""GGUF quant types load correctly: a tiny random Llama written as a llama.cpp GGUF (q/k
rows permuted as llama.cpp's converter does) in each type, loaded by pagedllm, matches
Hugging Face transformers holding the file's dequantized weights.

`gguf.quants.quantize` covers the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and BF16; it
cannot quantize K-quants, so those files hold random but valid K-quant blocks (random bit
fields, sane fp16 super-block scales), which exercises the same load path.

Q4_0 and Q8_0 files can also stay packed (the GGUF-packed weight method, used on CUDA); the
tests force that path on CPU and compare it with dequantize-at-load.
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


# ---------------------------------------------------------------- Q4_0 / Q8_0 kept packed
def _linear_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))}


def _greedy(llm, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
    return [(o.outputs[0].token_ids, [pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                      strict=True)]) for o in outs]


def test_gguf_pack_only_on_cuda_by_default(hf_llama, tmp_path, monkeypatch):
    """CPU keeps dequantize-at-load unless forced; CUDA keeps Q4_0 packed in blocks of 32."""
    from pagedllm.model_executor.layers.quantization import QuantConfig
    from pagedllm.model_executor.loader import gguf_file

    path = str(tmp_path / "tiny-Q4_0.gguf")
    write_gguf(hf_llama, path, "Q4_0")
    assert gguf_file.gguf_quant_config(path, torch.device("cpu")) is None
    assert gguf_file.gguf_quant_config(path, torch.device("cuda")) == QuantConfig("gguf", 4, 32, "q4_0")
    monkeypatch.setattr(gguf_file, "PACK_ON_CPU", True)
    assert gguf_file.gguf_quant_config(path, torch.device("cpu")) == QuantConfig("gguf", 4, 32, "q4_0")


@pytest.mark.parametrize("qtype,bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_gguf_packed_matches_dequantized(hf_llama, tmp_path, monkeypatch, qtype, bits):
    """Forced onto CPU, the packed path holds int32 words that dequantize bit for bit to the
    float path's weights (q/k un-permuted, GQA k included) and generates the same."""
    from pagedllm.model_executor.layers.linear import LinearBase
    from pagedllm.model_executor.layers.quantization.gguf import GGUFPackedMethod
    from pagedllm.model_executor.loader import gguf_file

    path = str(tmp_path / f"tiny-{qtype}.gguf")
    write_gguf(hf_llama, path, qtype)
    kw = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    floats = LLM(model=path, **kw)
    monkeypatch.setattr(gguf_file, "PACK_ON_CPU", True)
    packed = LLM(model=path, **kw)
    fm, pm = floats.engine.executor.model, packed.engine.executor.model
    layers = _linear_layers(pm)
    assert len(layers) == 4 * hf_llama.config.num_hidden_layers
    for name, m in layers.items():
        assert isinstance(m.method, GGUFPackedMethod) and m.quant.bits == bits and m.quant.group_size == 32
        assert m.qweight.dtype == torch.int32 and m.weight is None
        assert torch.equal(m.dequantized_weight(torch.float32), _linear_layers(fm)[name].weight), name
    # Embeddings and the output head stay float.
    assert not any(isinstance(m, LinearBase) and m.quant is not None for n, m in pm.named_modules()
                   if n not in layers)
    assert packed.engine.executor.weight_bytes < floats.engine.executor.weight_bytes
    prompt_ids = prompts(2, seed=7)
    for (ft, flp), (pt, plp) in zip(_greedy(floats, prompt_ids), _greedy(packed, prompt_ids), strict=True):
        assert pt == ft
        assert plp == pytest.approx(flp, abs=1e-5)


def test_gguf_mixed_linear_types_fall_back(hf_llama, tmp_path, monkeypatch):
    """A Q4_0 file with one Q8_0 linear layer cannot share one packed layout: it loads
    dequantized, correctly, with no error."""
    from pagedllm.model_executor.layers.linear import LinearBase
    from pagedllm.model_executor.loader import gguf_file

    q8 = gguf.GGMLQuantizationType.Q8_0
    add_tensor = gguf.GGUFWriter.add_tensor

    def add_mixed(self, name, tensor, *args, raw_dtype=None, **kwargs):
        if name == "blk.0.ffn_down.weight":
            tensor, raw_dtype = gguf.quants.quantize(gguf.quants.dequantize(tensor, raw_dtype), q8), q8
        return add_tensor(self, name, tensor, *args, raw_dtype=raw_dtype, **kwargs)

    path = str(tmp_path / "tiny-mixed.gguf")
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_tensor", add_mixed)
        write_gguf(hf_llama, path, "Q4_0")
    monkeypatch.setattr(gguf_file, "PACK_ON_CPU", True)
    assert gguf_file.gguf_quant_config(path, torch.device("cpu")) is None
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    assert not any(isinstance(m, LinearBase) and m.quant is not None for m in llm.engine.executor.model.modules())
    state = dict(gguf_file.gguf_weights(path, gguf_file.gguf_config(path)))
    assert_parity(llm, reference_model(hf_llama, state), prompts(2, seed=9), max_new=6)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_gguf_packed_on_cuda_by_default(hf_llama, tmp_path, qtype, bits):
    """On CUDA a Q4_0 / Q8_0 file stays packed and runs through the Triton kernel (CUDA
    graphs and async scheduling included); it generates what the CPU float path does."""
    from pagedllm.model_executor.layers.quantization.gguf import GGUFPackedMethod

    path = str(tmp_path / f"tiny-{qtype}.gguf")
    write_gguf(hf_llama, path, qtype)
    kw = dict(skip_tokenizer_init=True, block_size=16, num_kv_blocks=64, dtype="float32")
    cpu = LLM(model=path, device="cpu", **kw)
    gpu = LLM(model=path, device="cuda", **kw)
    layers = _linear_layers(gpu.engine.executor.model)
    assert all(isinstance(m.method, GGUFPackedMethod) and m.quant.bits == bits and m.method.tile_k
               for m in layers.values())
    prompt_ids = prompts(3, seed=9)
    for (ct, clp), (gt, glp) in zip(_greedy(cpu, prompt_ids), _greedy(gpu, prompt_ids), strict=True):
        assert gt == ct
        assert glp == pytest.approx(clp, abs=1e-3)


@pytest.mark.parametrize("qtype,bits", [("Q4_0", 4), ("Q8_0", 8)])
def test_gguf_packed_layer_shards_are_slices_of_the_full_layer(monkeypatch, qtype, bits):
    """Under tensor parallelism a GGUF-packed layer cuts its rank's rows (column-parallel)
    or whole blocks of its input slice (row-parallel) out of the file's raw blocks, and
    dequantizes to exactly that slice of the file's weight."""
    import numpy as np

    from pagedllm.distributed import parallel_state
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedllm.model_executor.layers.quantization import QuantConfig

    k, n = 256, 64
    w = np.random.default_rng(0).normal(size=(n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    blocks = torch.from_numpy(gguf.quants.quantize(w, t))  # uint8 [n, bytes per row]
    full = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), t))
    quant = QuantConfig("gguf", bits, 32, qtype.lower())
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_state", parallel_state._State(rank, 2))
        col = ColumnParallelLinear(k, n, False, quant)
        row = RowParallelLinear(k, n, False, quant)
        for layer in (col, row):
            layer.load_shard("weight", None, blocks)
            layer.finish_loading()
        assert torch.equal(col.dequantized_weight(torch.float32), full[rank * n // 2:(rank + 1) * n // 2])
        assert torch.equal(row.dequantized_weight(torch.float32), full[:, rank * k // 2:(rank + 1) * k // 2])
        assert row.qweight.shape == (k // 2 * bits // 32, n) and row.scales.shape == (k // 2 // 32, n)
    with pytest.raises(ValueError, match="has no place"):
        col.load_shard("qweight", None, blocks)
