"""GPTQ and AWQ checkpoints: packing round trips, layer-level dequantization, detection,
and whole-model parity with Hugging Face transformers holding the dequantized weights.

The checkpoints come from tests/quant_packers.py (our own converter from the format
facts). A quantized model's greedy tokens differ from the float model's, so equality with
the dequantized reference shows the quantized tensors were really read.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_models import save_tiny_model
from quant_packers import (
    AWQ_ORDER,
    AWQSpec,
    GPTQSpec,
    assert_parity,
    pack,
    prompts,
    quantize_awq,
    quantize_gptq,
    reference_model,
    unpack,
    write_quantized_checkpoint,
)

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, LinearBase
from pagedllm.model_executor.layers.quantization import (
    QuantConfig,
    detect_quant_config,
)
from pagedllm.model_executor.layers.quantization import packing as pk
from pagedllm.model_executor.layers.quantization.gptq_awq import PackedMethod
from pagedllm.model_executor.layers.weight_method import DenseMethod

# Big enough for group sizes 32/64/128 to be real groups: hidden 128, MLP 256, head_dim 32.
SHAPE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    return str(path), save_tiny_model(str(path), "llama", **SHAPE)


# ---------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(bits):
    rng = np.random.default_rng(bits)
    vals = rng.integers(0, 1 << bits, size=(64, 48))
    t = torch.from_numpy(vals)
    # along the input (GPTQ qweight): test packer and pagedllm agree both ways
    rows = pack(vals, bits, axis=0)
    assert np.array_equal(pk.pack_rows(t, bits).numpy(), rows)
    assert np.array_equal(pk.unpack_rows(torch.from_numpy(rows), bits).numpy(), vals)
    # along the output (qzeros)
    cols = pack(vals, bits, axis=1)
    assert np.array_equal(pk.pack_cols(t, bits).numpy(), cols)
    assert np.array_equal(pk.unpack_cols(torch.from_numpy(cols), bits).numpy(), vals)
    assert np.array_equal(unpack(cols, bits, axis=1), vals)


def test_awq_interleave_round_trip():
    vals = np.random.default_rng(0).integers(0, 16, size=(16, 32))
    words = pack(vals, 4, axis=1, order=AWQ_ORDER)
    # nibble k of word c is column 8c + ORDER[k]
    assert (words[0, 0].view(np.uint32) >> 4) & 0xF == vals[0, AWQ_ORDER[1]]
    assert np.array_equal(pk.unpack_cols(torch.from_numpy(words), 4, pk.AWQ_ORDER).numpy(), vals)
    assert np.array_equal(pk.pack_cols(torch.from_numpy(vals), 4, pk.AWQ_ORDER).numpy(), words)
    assert np.array_equal(unpack(words, 4, axis=1, order=AWQ_ORDER), vals)


def test_gptq_v1_symmetric_zeros_are_0x77777777():
    w = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
    t, _ = quantize_gptq(w, GPTQSpec(group_size=32))
    assert (t["qzeros"].view(np.uint32) == 0x77777777).all()
    t2, _ = quantize_gptq(w, GPTQSpec(group_size=32, checkpoint_format="gptq_v2"))
    assert (t2["qzeros"].view(np.uint32) == 0x88888888).all()


# ---------------------------------------------------------------------------- one layer
def _quantized(m: torch.nn.Module) -> bool:
    """A linear layer built for a quantized format (it may have become dense at load)."""
    return isinstance(m, LinearBase) and m.quant is not None


def _load_layer(tensors: dict[str, np.ndarray], quant: QuantConfig, k: int, n: int) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(k, n, False, quant)
    for name, v in tensors.items():
        layer.load_shard(name, None, torch.from_numpy(np.ascontiguousarray(v)))
    layer.finish_loading()
    return layer


GPTQ_LAYER_SPECS = [
    GPTQSpec(4, 32, True), GPTQSpec(4, 64, False), GPTQSpec(4, 128, False, checkpoint_format="gptq_v2"),
    GPTQSpec(4, -1, True), GPTQSpec(4, 32, False, act_order=True), GPTQSpec(4, -1, False, act_order=True),
    GPTQSpec(8, 64, False, act_order=True), GPTQSpec(8, 128, True), GPTQSpec(2, 32, False, checkpoint_format="gptq_v2"),
]


@pytest.mark.parametrize("spec", GPTQ_LAYER_SPECS, ids=repr)
def test_gptq_layer_dequantizes_exactly(spec):
    k, n = 256, 48
    w = np.random.default_rng(1).normal(size=(n, k)).astype(np.float32)
    tensors, deq = quantize_gptq(w, spec, np.random.default_rng(2).permutation(k))
    quant = QuantConfig("gptq", spec.bits, spec.group_size, spec.checkpoint_format)
    layer = _load_layer(tensors, quant, k, n)
    assert (layer.perm is not None) == (spec.act_order and spec.group_size != -1)  # one group: no order
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(deq))
    x = torch.randn(5, k)
    assert torch.allclose(layer(x), x @ torch.from_numpy(deq).T, atol=1e-5)
    assert np.abs(deq - w).max() <= np.abs(w).max() * 2 / ((1 << spec.bits) - 1) + 1e-6  # error <= a step


@pytest.mark.parametrize("version", ["gemm", "gemv"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_layer_dequantizes_exactly(group_size, version):
    """GEMM (interleaved, output-packed) and GEMV (transposed, zero-padded group words)
    layouts load into the same weights; k = 320 gives GEMV ragged group words."""
    k, n = 320 if group_size < 128 else 256, 48
    w = np.random.default_rng(3).normal(size=(n, k)).astype(np.float32)
    tensors, deq = quantize_awq(w, AWQSpec(group_size, version=version))
    if version == "gemv":
        assert tensors["qweight"].shape == (n, k // 8) and tensors["qzeros"].shape[0] == n
    fmt = "awq" if version == "gemm" else "awq_gemv"
    layer = _load_layer(tensors, QuantConfig("awq", 4, group_size, fmt), k, n)
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(deq))


def test_fused_layer_takes_shards_side_by_side():
    """q|k|v shards land in their own output columns (qzeros in packed columns)."""
    spec = GPTQSpec(4, 32, False, act_order=True)
    perm = np.random.default_rng(4).permutation(64)  # one input: one act-order for all shards
    sizes = {"q": 64, "k": 32, "v": 16}
    quant = QuantConfig("gptq", 4, 32, "gptq")
    layer = ColumnParallelLinear(64, sizes, False, quant)
    expected = []
    for i, (shard, size) in enumerate(sizes.items()):
        w = np.random.default_rng(10 + i).normal(size=(size, 64)).astype(np.float32)
        tensors, deq = quantize_gptq(w, spec, perm)
        for name, v in tensors.items():
            layer.load_shard(name, shard, torch.from_numpy(v))
        expected.append(deq)
    layer.finish_loading()
    assert torch.equal(layer.dequantized_weight(), torch.from_numpy(np.concatenate(expected)))


def test_fused_shards_with_different_act_order_are_refused():
    spec = GPTQSpec(4, 32, False, act_order=True)
    layer = ColumnParallelLinear(64, {"gate": 32, "up": 32}, False, QuantConfig("gptq", 4, 32))
    for i, shard in enumerate(("gate", "up")):
        w = np.random.default_rng(i).normal(size=(32, 64)).astype(np.float32)
        tensors, _ = quantize_gptq(w, spec, np.random.default_rng(20 + i).permutation(64))
        for name, v in tensors.items():
            layer.load_shard(name, shard, torch.from_numpy(v))
    with pytest.raises(ValueError, match="different g_idx"):
        layer.finish_loading()


def test_missing_tensor_is_reported():
    layer = ColumnParallelLinear(64, 32, False, QuantConfig("gptq", 4, 32))
    tensors, _ = quantize_gptq(np.ones((32, 64), np.float32), GPTQSpec(4, 32))
    layer.load_shard("qweight", None, torch.from_numpy(tensors["qweight"]))
    with pytest.raises(ValueError, match="qzeros"):
        layer.finish_loading()


# ---------------------------------------------------------------------------- whole models
MODEL_SPECS = [
    GPTQSpec(4, 128, sym=True),
    GPTQSpec(4, 32, sym=False),
    GPTQSpec(4, 64, sym=False, act_order=True, checkpoint_format="gptq_v2"),
    GPTQSpec(4, -1, sym=True, act_order=True),
    GPTQSpec(8, 64, sym=False, act_order=True),
    GPTQSpec(4, 128, sym=True, lm_head=True, side_file=True),
    AWQSpec(128),
    AWQSpec(64, not_converted=("mlp.down_proj",)),
    AWQSpec(128, version="gemv"),
    AWQSpec(32, version="gemv"),
]


@pytest.mark.parametrize("spec", MODEL_SPECS, ids=repr)
def test_quantized_model_matches_hf(float_model, tmp_path, spec):
    _, hf = float_model
    ref = reference_model(hf, write_quantized_checkpoint(hf, str(tmp_path), spec))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    assert_parity(llm, ref, prompts(3, seed=7))
    model = llm.engine.executor.model
    layers = [m for m in model.modules() if _quantized(m)]
    assert _quantized(model.lm_head) == (isinstance(spec, GPTQSpec) and spec.lm_head)
    assert len(layers) == 2 * 4 + (1 if _quantized(model.lm_head) else 0)
    down = [m for m in layers if m.in_features == 256] if isinstance(spec, AWQSpec) and spec.not_converted else []
    if down:  # kept float: the layer became dense
        assert all(m.weight is not None and m.qweight is None and isinstance(m.method, DenseMethod) for m in down)
    assert all(isinstance(m.method, PackedMethod) and m.qweight is not None for m in layers if m not in down)


def test_quantized_outputs_differ_from_the_float_model(float_model, tmp_path):
    """The parity tests above would pass vacuously if quantization changed nothing."""
    _, hf = float_model
    write_quantized_checkpoint(hf, str(tmp_path), GPTQSpec(4, 128))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts(3, seed=7)],
                       SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True))
    diffs = []
    for p, o in zip(prompts(3, seed=7), out, strict=True):
        tok = o.outputs[0].token_ids[0]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p])).logits[0, -1], -1)[tok].item()
        diffs.append(abs(o.outputs[0].logprobs[0][tok].logprob - lp))
    assert max(diffs) > 1e-3


def test_weight_memory_counts_packed_tensors(float_model, tmp_path):
    float_path, _ = float_model
    _, hf = float_model
    write_quantized_checkpoint(hf, str(tmp_path), GPTQSpec(4, 32, sym=False, act_order=True))
    q = LLM(model=str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=16)
    f = LLM(model=float_path, skip_tokenizer_init=True, num_kv_blocks=16)
    model = q.engine.executor.model
    packed = sum(p.numel() * p.element_size() for m in model.modules() if _quantized(m)
                 for p in m.parameters())
    linear_float = sum(m.weight.numel() * 4 for m in f.engine.executor.model.modules()
                       if isinstance(m, LinearBase) and m is not f.engine.executor.model.lm_head)
    # int32 words + fp16 scales + packed zeros + int32 act-order permutation, no float copy
    assert packed < linear_float / 4
    float_rest = f.engine.executor.weight_bytes - linear_float
    assert q.engine.executor.weight_bytes == float_rest + packed
    assert q.engine.describe()["weights_GiB"] < f.engine.describe()["weights_GiB"]


def test_detection_and_mismatch(float_model, tmp_path):
    float_path, hf = float_model
    write_quantized_checkpoint(hf, str(tmp_path / "gptq"), GPTQSpec(side_file=True))
    write_quantized_checkpoint(hf, str(tmp_path / "awq"), AWQSpec())
    from transformers import AutoConfig

    assert detect_quant_config(str(tmp_path / "gptq"), AutoConfig.from_pretrained(tmp_path / "gptq")).method == "gptq"
    assert detect_quant_config(str(tmp_path / "awq"), AutoConfig.from_pretrained(tmp_path / "awq")).method == "awq"
    assert detect_quant_config(float_path, AutoConfig.from_pretrained(float_path)) is None
    LLM(model=str(tmp_path / "awq"), quantization="AWQ", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(model=str(tmp_path / "gptq"), quantization="awq", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="float checkpoint"):
        LLM(model=float_path, quantization="gptq", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="not a GGUF"):
        LLM(model=float_path, quantization="gguf", skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="quantization must be"):
        LLM(model=float_path, quantization="bitsandbytes", skip_tokenizer_init=True, num_kv_blocks=16)


@pytest.mark.parametrize(("raw", "message"), [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "gemv_fast"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "pack-quantized"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
])
def test_unsupported_layouts_fail_loudly(tmp_path, float_model, raw, message):
    float_path, _ = float_model
    cfg = json.loads(open(f"{float_path}/config.json").read())
    cfg["quantization_config"] = raw
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(f"{float_path}/model.safetensors")
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=16)


def test_awq_old_side_file_spelling(tmp_path, float_model):
    """Older AutoAWQ wrote quant_config.json with w_bit / q_group_size / "GEMM"."""
    _, hf = float_model
    ref = reference_model(hf, write_quantized_checkpoint(hf, str(tmp_path), AWQSpec(64)))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "quant_config.json").write_text(json.dumps(
        {"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    assert_parity(llm, ref, prompts(1, seed=3))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_dummy_weights_with_quantization(tmp_path, method):
    """load_format='dummy' + quantization builds packed layers (the benchmark's path)."""
    from hf_models import make_config

    cfg = make_config("llama", **SHAPE).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy", quantization=method, skip_tokenizer_init=True,
              num_kv_blocks=32)
    layers = [m for m in llm.engine.executor.model.modules() if _quantized(m)]
    assert len(layers) == 8 and all(isinstance(m.method, PackedMethod) for m in layers)
    w = layers[0].dequantized_weight()
    assert 0.01 < w.std().item() < 0.04 and abs(w.mean().item()) < 0.005
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
