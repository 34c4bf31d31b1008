"""FP8 (e4m3) weights: the published checkpoint layouts load and compute their dequantized
weights, quantization="fp8" quantizes a float checkpoint at load, shards under tensor
parallelism are slices of the whole layer, and (on a GPU with FP8 tensor cores) the
torch._scaled_mm product agrees with the dequantized one.

The checkpoints come from tests/quant_packers.py (write_fp8_checkpoint, written from the
formats' own definitions; its compressed-tensors files decompress with the
compressed-tensors package to the same weights rounded to bf16, and its FineGrainedFP8
files dequantize in transformers to exactly the same weights). The reference is Hugging
Face transformers holding those dequantized weights in float32, the "twin": on CPU the
engine dequantizes once at load into float32, so greedy tokens are equal and logprobs
agree to 1e-4 (assert_parity), the tolerance of the GPTQ/AWQ parity tests.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from hf_models import save_tiny_model
from quant_packers import (
    FP8Spec,
    GPTQSpec,
    assert_parity,
    fake_quantize_fp8_rows,
    prompts,
    quantize_fp8,
    reference_model,
    write_fp8_checkpoint,
    write_quantized_checkpoint,
)

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
)
from pagedllm.model_executor.layers.quantization import QuantConfig, parse_quant_config
from pagedllm.model_executor.layers.quantization import fp8 as fp8_method
from pagedllm.model_executor.layers.quantization.fp8 import Fp8Method
from pagedllm.model_executor.layers.weight_method import DenseMethod

# hidden 128 / MLP 256: 128x128 blocks are whole; k/v (2 heads x 32) are half a block of rows.
SHAPE = dict(hidden_size=128, intermediate_size=256)
# hidden 192 / MLP 320: partial blocks along both dimensions of every block-scaled weight.
RAGGED = dict(hidden_size=192, intermediate_size=320)
# The CPU tests pin the CPU: on a GPU machine the default device would take the FP8
# tensor-core path, whose activations are e4m3-rounded (the CUDA tests below cover it).
KW = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, device="cpu")


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("float")
    return str(path), save_tiny_model(str(path), "llama", **SHAPE)


@pytest.fixture(scope="module")
def ragged_model(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("ragged")), "llama", **RAGGED)


def _fp8_layers(model) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase) and m.quant is not None]


# ---------------------------------------------------------------------------- detection
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {"dynamic": True, "num_bits": 8,
                                                                                 "type": "float", "strategy": "token"},
                                    "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                "strategy": "channel"}}}}


def _ct(**weights) -> dict:
    raw = json.loads(json.dumps(CT))
    raw["config_groups"]["group_0"]["weights"].update(weights)
    return raw


@pytest.mark.parametrize(("raw", "expected"), [
    (_ct(), ("compressed-tensors", "channel", None, False)),
    (_ct(strategy="tensor"), ("compressed-tensors", "tensor", None, False)),
    (_ct(strategy="block", block_structure=[128, 128]), ("compressed-tensors", "block", (128, 128), False)),
    (_ct(strategy="group", group_size=128), ("compressed-tensors", "block", (1, 128), False)),
    ({**_ct(), "ignore": ["re:.*mlp.gate$"]}, ("compressed-tensors", "channel", None, True)),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     ("fp8", "block", (128, 128), False)),
    ({"quant_method": "fp8", "activation_scheme": "static"}, ("fp8", "tensor", None, False)),  # AutoFP8
    ({"quant_method": "fp8", "weight_block_size": None}, ("fp8", "tensor", None, False)),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, ("fbgemm_fp8", "channel", None, False)),
    # ModelOpt: hf_quant_config.json (no quant_method), and config.json's spelling
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                         "exclude_modules": ["lm_head"]}},
     ("modelopt", "tensor", None, False)),
    ({"quantization": {"quant_algo": "fp8_per_channel_per_token", "exclude_modules": ["model.layers.0.mlp*"]}},
     ("modelopt", "channel", None, True)),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO", "ignore": ["lm_head*"]},
     ("modelopt", "block", (128, 128), False)),
])
def test_fp8_configs_are_detected(raw, expected):
    q = parse_quant_config(raw)
    assert q.method == "fp8" and q.bits == 8
    assert (q.checkpoint_format, q.strategy, q.block_size, q.lm_head) == expected
    assert q.scale_names[-1] == "weight_scale"


@pytest.mark.parametrize(("raw", "message"), [
    ({**_ct(num_bits=4, type="int"), "format": "pack-quantized"}, "pack-quantized"),
    (_ct(type="int"), "8-bit float weights"),
    (_ct(symmetric=False), "symmetric"),
    ({**CT, "config_groups": {"a": CT["config_groups"]["group_0"],
                              "b": _ct(strategy="tensor")["config_groups"]["group_0"]}}, "different weight scales"),
    ({"quant_method": "fp8", "modules_to_convert": ["model.embed_tokens"]}, "embeddings"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "config_groups"),
    ({"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}, "NVFP4"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "not supported"),
    ({"quant_method": "modelopt"}, "no quant_algo"),
])
def test_unsupported_fp8_layouts_fail_loudly(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_quant_config(raw)


# ---------------------------------------------------------------------------- one layer
def _load(layer: LinearBase, tensors: dict[str, torch.Tensor], shard: str | None = None) -> None:
    for name, t in tensors.items():
        layer.load_shard(name, shard, t)


SPECS = [FP8Spec("compressed-tensors", "tensor"), FP8Spec("compressed-tensors", "channel"),
         FP8Spec("compressed-tensors", "block"), FP8Spec("compressed-tensors", "block", (1, 64)),
         FP8Spec("fp8", "block"), FP8Spec("fp8", "tensor"), FP8Spec("fbgemm_fp8", "channel"),
         FP8Spec("autofp8", "tensor"), FP8Spec("modelopt", "tensor"), FP8Spec("modelopt", "channel"),
         FP8Spec("modelopt", "block")]


def _quant(spec: FP8Spec) -> QuantConfig:
    return parse_quant_config(spec.config(1))


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_fused_layer_dequantizes_each_shard_exactly(spec):
    """q|k|v shards of different sizes (k/v cut a 128-row block in half; 200 inputs leave a
    partial block), each with its own scale: the CPU layer holds exactly q * scale, and
    per-tensor shards keep their own scales (no requantization to a common one)."""
    sizes = {"q": 256, "k": 64, "v": 64}
    layer = ColumnParallelLinear(200, sizes, False, _quant(spec))
    expected = []
    for i, (shard, n) in enumerate(sizes.items()):
        w = torch.randn(n, 200, generator=torch.Generator().manual_seed(i)) * (i + 1)
        tensors, deq = quantize_fp8(w, spec, torch.float32)
        _load(layer, tensors, shard)
        expected.append(deq)
    layer.finish_loading()
    assert layer.weight_scale is None and layer.weight.dtype == torch.float32  # dequantized at load
    assert torch.equal(layer.weight, torch.cat(expected))
    x = torch.randn(3, 200)
    torch.testing.assert_close(layer(x), x @ torch.cat(expected).T)


def test_missing_and_wrong_scales_are_reported():
    spec = FP8Spec("compressed-tensors", "channel")
    tensors, _ = quantize_fp8(torch.randn(32, 64), spec, torch.bfloat16)
    layer = ColumnParallelLinear(64, 32, False, _quant(spec))
    layer.load_shard("weight", None, tensors["weight"])
    with pytest.raises(ValueError, match="weight_scale"):
        layer.finish_loading()
    with pytest.raises(ValueError, match=r"\(1,\)"):  # a per-tensor scale where channels are expected
        layer.load_shard("weight_scale", None, torch.ones(1))
    with pytest.raises(ValueError, match="no place"):
        layer.load_shard("qweight", None, torch.ones(1))


def test_float_shard_beside_fp8_shards_is_refused():
    spec = FP8Spec("compressed-tensors", "channel")
    layer = ColumnParallelLinear(64, {"gate": 32, "up": 32}, False, _quant(spec))
    tensors, _ = quantize_fp8(torch.randn(32, 64), spec, torch.bfloat16)
    _load(layer, tensors, "gate")
    layer.load_shard("weight", "up", torch.randn(32, 64))
    with pytest.raises(ValueError, match="came as a float weight"):
        layer.finish_loading()


def test_cpu_dequantization_is_logged(caplog):
    fp8_method._logged.clear()
    spec = FP8Spec("fbgemm_fp8", "channel")
    layer = ColumnParallelLinear(64, 32, False, _quant(spec))
    _load(layer, quantize_fp8(torch.randn(32, 64), spec, torch.float32)[0])
    with caplog.at_level(logging.INFO, logger=fp8_method.__name__):
        layer.finish_loading()
    assert "FP8 weights dequantized to float32 at load: this device has no FP8 matmul" in caplog.text
    assert not layer.method.fp8_matmul


# ---------------------------------------------------------------------------- whole models
MODEL_SPECS = [
    FP8Spec("compressed-tensors", "tensor", static_input=True),
    FP8Spec("compressed-tensors", "channel", not_converted=("mlp.down_proj",)),
    FP8Spec("compressed-tensors", "block"),
    FP8Spec("fp8", "block"),
    FP8Spec("fp8", "tensor"),
    FP8Spec("fbgemm_fp8", "channel"),
    FP8Spec("autofp8", "tensor", static_input=True),
    FP8Spec("modelopt", "tensor"),  # nvidia/*-FP8's layout: hf_quant_config.json, static input scales
    FP8Spec("modelopt-config", "channel"),
]


@pytest.mark.parametrize("spec", MODEL_SPECS, ids=repr)
def test_fp8_checkpoint_matches_its_dequantized_twin(float_model, tmp_path, spec):
    """The engine on the FP8 checkpoint = HF on the float32 weights it encodes."""
    _, hf = float_model
    ref = reference_model(hf, write_fp8_checkpoint(hf, str(tmp_path), spec))
    llm = LLM(model=str(tmp_path), **KW)
    assert_parity(llm, ref, prompts(3, seed=7))
    model = llm.engine.executor.model
    layers = _fp8_layers(model)
    assert len(layers) == 2 * 4 and model.lm_head not in layers  # qkv, o, gate_up, down per layer; head float
    dense = [m for m in layers if isinstance(m.method, DenseMethod)]
    assert len(dense) == (2 if spec.not_converted else 0)  # the unconverted down_proj layers
    assert all(isinstance(m.method, Fp8Method) and not m.method.fp8_matmul for m in layers if m not in dense)


def test_block_checkpoint_with_partial_blocks(ragged_model, tmp_path):
    """Every block-scaled weight ends in partial 128-blocks (192 and 320 features)."""
    ref = reference_model(ragged_model, write_fp8_checkpoint(ragged_model, str(tmp_path), FP8Spec("fp8", "block")))
    assert_parity(LLM(model=str(tmp_path), **KW), ref, prompts(2, seed=3))


def test_fp8_twin_differs_from_the_float_model(float_model, tmp_path):
    """The parity above would hold vacuously if the fp8 rounding changed nothing."""
    _, hf = float_model
    ref = reference_model(hf, write_fp8_checkpoint(hf, str(tmp_path), FP8Spec("compressed-tensors", "tensor")))
    ids = torch.tensor([prompts(1, seed=7)[0]])
    with torch.no_grad():
        diff = (hf(ids).logits - ref(ids).logits).abs().max().item()
    assert diff > 1e-3


def test_quantization_fp8_on_a_float_checkpoint(float_model, caplog):
    """quantization="fp8" quantizes every decoder linear layer per output row at load (not
    the head or embeddings); on CPU they are dequantized again, so the engine equals HF
    holding the quantize-dequantize of the original weights."""
    path, hf = float_model
    fp8_method._logged.clear()
    with caplog.at_level(logging.INFO, logger=fp8_method.__name__):
        llm = LLM(model=path, quantization="fp8", **KW)
    assert "FP8 weights dequantized to float32 at load: this device has no FP8 matmul" in caplog.text
    state = {name: fake_quantize_fp8_rows(t) if ".layers." in name and name.endswith("proj.weight") else t
             for name, t in hf.state_dict().items()}
    assert sum(not torch.equal(state[n], t) for n, t in hf.state_dict().items()) == 2 * 7
    assert_parity(llm, reference_model(hf, state), prompts(3, seed=7))
    model = llm.engine.executor.model
    assert len(_fp8_layers(model)) == 2 * 4 and model.lm_head not in _fp8_layers(model)


def test_dummy_weights_with_fp8(tmp_path):
    """load_format='dummy' + quantization='fp8' (the benchmark's path) builds FP8 layers."""
    from hf_models import make_config

    cfg = make_config("llama", **SHAPE).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy", quantization="fp8", skip_tokenizer_init=True,
              num_kv_blocks=32, device="cpu")
    layers = _fp8_layers(llm.engine.executor.model)
    assert len(layers) == 8 and all(isinstance(m.method, Fp8Method) for m in layers)
    w = layers[0].dequantized_weight()
    assert 0.01 < w.std().item() < 0.04
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantization_setting_must_agree_with_the_checkpoint(float_model, tmp_path):
    float_path, hf = float_model
    write_quantized_checkpoint(hf, str(tmp_path / "gptq"), GPTQSpec())
    write_fp8_checkpoint(hf, str(tmp_path / "fp8"), FP8Spec("fp8", "block"))
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(model=str(tmp_path / "gptq"), quantization="fp8", **KW)
    with pytest.raises(ValueError, match="quantized with 'fp8'"):
        LLM(model=str(tmp_path / "fp8"), quantization="awq", **KW)
    LLM(model=str(tmp_path / "fp8"), quantization="FP8", **KW)  # agrees: fine
    # vLLM's names of the FP8 formats: accepted for a checkpoint of that format only
    write_fp8_checkpoint(hf, str(tmp_path / "modelopt"), FP8Spec("modelopt", "tensor"))
    LLM(model=str(tmp_path / "modelopt"), quantization="modelopt", **KW)
    with pytest.raises(ValueError, match="modelopt FP8 checkpoint"):
        LLM(model=str(tmp_path / "modelopt"), quantization="fbgemm_fp8", **KW)
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        LLM(model=str(tmp_path / "gptq"), quantization="modelopt", **KW)


# ---------------------------------------------------------------------------- tensor parallel
def _as_rank(monkeypatch, rank: int, world: int = 2) -> None:
    from pagedllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_state", parallel_state._State(rank, world))


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_fp8_shards_are_slices_of_the_full_layer(monkeypatch, spec):
    """Column-parallel ranks keep their output rows and those rows' scales (a per-tensor
    scale replicated), row-parallel ranks their input columns and, for block scales, the
    scale columns of that slice."""
    k, n = 256, 192  # 96 rows a rank: column ranks cut a 128-row block
    tensors, deq = quantize_fp8(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), spec, torch.float32)
    for rank in range(2):
        _as_rank(monkeypatch, rank)
        col = ColumnParallelLinear(k, n, False, _quant(spec))
        row = RowParallelLinear(k, n, False, _quant(spec))
        for layer in (col, row):
            _load(layer, tensors)
            layer.finish_loading()
        assert torch.equal(col.dequantized_weight(), deq[rank * n // 2:(rank + 1) * n // 2])
        assert torch.equal(row.dequantized_weight(), deq[:, rank * k // 2:(rank + 1) * k // 2])


def test_row_parallel_block_split_must_fall_on_blocks(monkeypatch):
    _as_rank(monkeypatch, 1)
    with pytest.raises(ValueError, match="whole scale blocks of 128"):
        RowParallelLinear(128, 64, False, QuantConfig("fp8", 8, checkpoint_format="fp8", strategy="block",
                                                      block_size=(128, 128)))


def test_tp2_fp8_greedy_equals_tp1(float_model, tmp_path):
    """Per-tensor scales (replicated on both ranks, one per fused shard) through two worker
    processes: the same greedy tokens as one in-process engine."""
    from test_tensor_parallel import _assert_tp2_equals_tp1

    _, hf = float_model
    write_fp8_checkpoint(hf, str(tmp_path), FP8Spec("compressed-tensors", "tensor"))
    _assert_tp2_equals_tp1(str(tmp_path), device="cpu")


# ---------------------------------------------------------------------------- the FP8 matmul path
# PyTorch's CPU torch._scaled_mm has the row-wise recipe (not the 128-block ones), so the
# path CUDA takes (probe at load, per-token activations, scale layouts, bias, dtypes) runs
# here too once the device check is bypassed; only the GPU kernels themselves are not.
def _cpu_scaled_mm() -> bool:
    q = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


def _bf16_layer(spec: FP8Spec, sizes: dict[str | None, int], k: int, device=None):
    """A fused column-parallel FP8 layer with bias, built in bf16, loaded, finished; and
    the float32 weight it encodes."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device or "cpu"):
            layer = ColumnParallelLinear(k, sizes, True, _quant(spec))
    finally:
        torch.set_default_dtype(prev)
    weights = []
    for i, (shard, n) in enumerate(sizes.items()):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * (i + 1)
        tensors, deq = quantize_fp8(w, spec, torch.float32)
        _load(layer, tensors, shard)
        layer.load_shard("bias", shard, torch.randn(n, generator=torch.Generator().manual_seed(10 + i)))
        weights.append(deq)
    layer.finish_loading()
    return layer, torch.cat(weights)


def _assert_fp8_product(layer, w: torch.Tensor, device=None) -> None:
    for rows in (1, 7, 64):
        x = torch.randn(rows, layer.in_features, device=device, dtype=torch.bfloat16)
        out = layer(x)
        want = x.float() @ w.to(x.device).T + layer.bias.float()
        assert out.dtype == torch.bfloat16 and out.shape == want.shape
        err = ((out.float() - want).norm() / want.norm()).item()
        assert 0 < err < 0.08  # per-token e4m3 activations: a few percent, never exact


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this PyTorch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("spec", [FP8Spec("compressed-tensors", "tensor"), FP8Spec("fbgemm_fp8", "channel")],
                         ids=repr)
def test_scaled_mm_path_on_cpu(monkeypatch, spec):
    monkeypatch.setattr(Fp8Method, "_why_not_fp8", lambda self, layer: None)
    layer, w = _bf16_layer(spec, {"q": 128, "k": 32, "v": 32}, 256)
    assert layer.method.fp8_matmul and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == (192, 1) and layer.weight_scale.dtype == torch.float32
    _assert_fp8_product(layer, w)
    x = torch.randn(3, 256, dtype=torch.bfloat16)  # batch-invariant mode: the dequantized product
    from pagedllm import batch_invariant

    with batch_invariant.enabled(True):
        assert torch.equal(layer(x), batch_invariant.linear(x, w.bfloat16(), layer.bias))


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this PyTorch has no CPU torch._scaled_mm")
def test_fast_accumulation_is_passed_to_scaled_mm(monkeypatch):
    """PAGEDLLM_FP8_FAST_ACCUM (read at start-up into FAST_ACCUM) reaches every row-wise
    product as use_fast_accum, and the product stays the layer's."""
    monkeypatch.setattr(Fp8Method, "_why_not_fp8", lambda self, layer: None)
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    for fast in (True, False):
        monkeypatch.setattr(fp8_method, "FAST_ACCUM", fast)
        seen.clear()
        layer, w = _bf16_layer(FP8Spec("compressed-tensors", "channel"), {"q": 128, "k": 32, "v": 32}, 256)
        _assert_fp8_product(layer, w)
        assert seen and set(seen) == {fast}
    code = "from pagedllm.model_executor.layers.quantization import fp8; print(fp8.FAST_ACCUM)"
    for value, want in (("1", "True"), ("0", "False"), (None, "True")):  # on by default
        env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_FP8_FAST_ACCUM"}
        if value is not None:
            env["PAGEDLLM_FP8_FAST_ACCUM"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, out.stderr[-2000:]


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this PyTorch has no CPU torch._scaled_mm")
def test_refused_scaled_mm_falls_back_to_dequantized_weights(monkeypatch, caplog):
    """Block scales: the CPU torch._scaled_mm has no 128-block recipe, so the probe at load
    fails and the layer is dequantized, with a warning, instead of failing in a forward."""
    monkeypatch.setattr(Fp8Method, "_why_not_fp8", lambda self, layer: None)
    fp8_method._logged.clear()
    with caplog.at_level(logging.WARNING, logger=fp8_method.__name__):
        layer, w = _bf16_layer(FP8Spec("fp8", "block"), {"gate": 256, "up": 256}, 256)
    assert "torch._scaled_mm refused the layer" in caplog.text
    assert not layer.method.fp8_matmul and layer.weight.dtype == torch.bfloat16 and layer.weight_scale is None
    assert torch.equal(layer.weight, w.bfloat16())


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this PyTorch has no CPU torch._scaled_mm")
def test_model_runs_on_the_scaled_mm_path(float_model, tmp_path, monkeypatch):
    """A whole bf16 model with its weights kept in fp8: 1 byte a linear weight in the
    engine's weight memory, and generation through torch._scaled_mm."""
    monkeypatch.setattr(Fp8Method, "_why_not_fp8", lambda self, layer: None)
    _, hf = float_model
    write_fp8_checkpoint(hf, str(tmp_path), FP8Spec("compressed-tensors", "channel"))
    llm = LLM(model=str(tmp_path), dtype="bfloat16", **KW)
    model = llm.engine.executor.model
    layers = _fp8_layers(model)
    assert all(m.method.fp8_matmul and m.weight.dtype == torch.float8_e4m3fn for m in layers)
    linear = sum(m.weight.numel() for m in layers)
    rows = sum(m.out_features for m in layers)
    rest = sum(p.numel() * 2 for n, p in model.named_parameters() if not n.endswith(("proj.weight", "weight_scale")))
    assert llm.engine.executor.weight_bytes == linear + 4 * rows + rest
    out = llm.generate([{"prompt_token_ids": p} for p in prompts(2, seed=7)],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)


def test_token_block_quantization_layout():
    """Activations per token and 128 inputs (the 1x128 recipe): scale [M, K/128] stored
    outer-dim-major (strides (1, M)), partial last block, x ~ q * scale within e4m3."""
    x = torch.randn(5, 300) * torch.linspace(0.1, 10, 300)
    q, s = fp8_method.quantize_token_blocks(x, 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and q.is_contiguous()
    assert s.shape == (5, 3) and s.stride() == (1, 5)
    back = q.float() * s.repeat_interleave(128, dim=1)[:, :300]
    assert ((back - x).abs() <= x.abs() / 16 + s.repeat_interleave(128, 1)[:, :300] * 2**-9).all()
    for j in range(3):  # each block's largest value maps to 448
        assert torch.equal(q[:, j * 128:(j + 1) * 128].float().abs().amax(1), torch.full((5,), 448.0))


# ---------------------------------------------------------------------------- CUDA
def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [FP8Spec("compressed-tensors", "tensor"), FP8Spec("fbgemm_fp8", "channel"),
                                  FP8Spec("fp8", "block")], ids=repr)
def test_scaled_mm_matches_the_dequantized_product(spec):
    """On a GPU with FP8 tensor cores the layer keeps fp8 weights and multiplies with
    torch._scaled_mm (block scales: on SM90); its bf16 product is within the error of
    per-token e4m3 activations (about 3%, here < 8%) of the dequantized product."""
    if not _fp8_gpu():
        pytest.skip("needs compute capability 8.9 or newer")
    layer, w = _bf16_layer(spec, {"q": 512, "k": 128, "v": 128}, 1024, device="cuda")
    assert layer.method.fp8_matmul == (spec.strategy != "block" or _block_scaled_mm_runs())
    _assert_fp8_product(layer, w, device="cuda")


def _block_scaled_mm_runs() -> bool:
    """Whether this torch/cuBLAS multiplies the 1x128 block recipe at all (SM90 and cuBLAS
    12.9 or newer; torch 2.11 + CUDA 13.0 on an H200 was seen refusing it with
    CUBLAS_STATUS_NOT_SUPPORTED): the layer must keep fp8 weights exactly when it does."""
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    w = (torch.randn(768, 1024, device="cuda") * 0.1).to(torch.float8_e4m3fn)
    scale = torch.ones(768, 8, device="cuda").t().contiguous().t()
    try:  # the test layer's shape, at a decode's rows and an odd prefill's
        for m in (1, 17):
            fp8_method.scaled_mm(torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16), w, scale, 128)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


@pytest.mark.gpu
def test_fast_accumulation_on_cuda(monkeypatch):
    """The fast-accumulation mode on the trt decode's widest input (K = 14,336, 512 rows):
    within the per-token e4m3 error of the dequantized product, and adding at most a
    small share to the promoted product's error (what decides whether it may be on)."""
    if not _fp8_gpu():
        pytest.skip("needs compute capability 8.9 or newer")
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 14336, device="cuda", generator=g) * 0.02
    q, scale = fp8_method.quantize_rows(w)
    x = torch.randn(512, 14336, device="cuda", generator=g).to(torch.bfloat16)
    want = x.float() @ fp8_method.dequantize(q, scale, 14336, torch.float32).T
    errs = {}
    for fast in (False, True):
        monkeypatch.setattr(fp8_method, "FAST_ACCUM", fast)
        got = fp8_method.rowwise_mm(*fp8_method.quantize_tokens(x), q, scale).float()
        errs[fast] = ((got - want).norm() / want.norm()).item()
    assert 0 < errs[False] < 0.05 and errs[True] < errs[False] + 0.01, errs


@pytest.mark.gpu
def test_fp8_checkpoint_generates_on_cuda(float_model, tmp_path):
    """The whole model on CUDA with FP8 matmuls follows the bf16 twin's greedy tokens at
    first (the activations' e4m3 rounding may flip a later near-tie)."""
    if not _fp8_gpu():
        pytest.skip("needs compute capability 8.9 or newer")
    _, hf = float_model
    write_fp8_checkpoint(hf, str(tmp_path), FP8Spec("compressed-tensors", "channel"))
    llm = LLM(model=str(tmp_path), device="cuda", dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=64)
    layers = _fp8_layers(llm.engine.executor.model)
    assert layers and all(m.method.fp8_matmul and m.weight.dtype == torch.float8_e4m3fn for m in layers)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts(3, seed=7)],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


@pytest.mark.gpu
def test_triton_token_quantization_equals_torch():
    """The one-pass Triton quantization does the torch form's arithmetic: equal scales and
    equal e4m3 values (both divide in float32 and round to nearest)."""
    from pagedllm.model_executor.layers.quantization.fp8_quant_kernel import quantize_tokens_triton

    torch.manual_seed(0)
    for m, k in [(1, 4096), (7, 11008), (300, 14336), (5, 100)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        x[0, :7] = 0  # a partly zero row
        q, s = quantize_tokens_triton(x)
        qt, st = fp8_method.quantize_tokens_torch(x)
        torch.testing.assert_close(s, st, rtol=0, atol=0)
        assert torch.equal(q.view(torch.uint8), qt.view(torch.uint8))
    q, s = quantize_tokens_triton(torch.zeros(2, 64, device="cuda"))
    assert torch.isfinite(s).all() and not q.float().any()


@pytest.mark.gpu
def test_one_row_takes_the_weight_only_kernel(monkeypatch):
    """A decode row of an FP8 layer (per-row scales) goes through skinny_gemm against the
    fp8 weight as it is: no per-token rounding of the activations, so it is within bf16's
    rounding of the dequantized product; 7 rows, or PAGEDLLM_SKINNY_FP8_MAX_ROWS=0, keep
    torch._scaled_mm."""
    if not _fp8_gpu():
        pytest.skip("needs compute capability 8.9 or newer")
    from pagedllm.model_executor.layers import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 1)  # PAGEDLLM_SKINNY_FP8_MAX_ROWS=1
    layer, w = _bf16_layer(FP8Spec("fbgemm_fp8", "channel"), {"q": 512, "k": 128, "v": 128}, 1024, device="cuda")
    assert layer.method.fp8_matmul and layer.method.skinny
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ w.cuda().T + layer.bias.float()
    out = layer(x)
    assert calls and out.dtype == torch.bfloat16
    assert ((out.float() - want).norm() / want.norm()).item() < 0.01
    calls.clear()
    layer(torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16))
    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 0)
    layer(x)
    assert not calls


@pytest.mark.gpu
def test_batch_one_decode_with_the_weight_only_kernel(float_model, tmp_path, monkeypatch):
    """One sequence at a time (decode steps of one row, CUDA graphs): the FP8 model's greedy
    tokens and logprobs follow the same model with its weights dequantized to float16 at load
    (the kernel multiplies the same weights; only rounding differs), and the kernel ran.
    The row limit is raised past the prompts (up to 24 tokens) so that their rows take the
    kernel too: with a limit of 1 the prompts went through torch._scaled_mm, whose e4m3
    activations moved this random model's near-tied logits (an H100 run saw fewer than 14
    of 16 tokens agree), which is not what this test is about. Both engines run in float16:
    in bf16 their own rounding (the only difference) moved a logprob by 0.105 on an H100,
    over the 0.05 asked; float16 keeps three more mantissa bits."""
    if not _fp8_gpu():
        pytest.skip("needs compute capability 8.9 or newer")
    from pagedllm.model_executor.layers import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 32)  # PAGEDLLM_SKINNY_FP8_MAX_ROWS=32
    _, hf = float_model
    write_fp8_checkpoint(hf, str(tmp_path), FP8Spec("compressed-tensors", "channel"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    reqs = [{"prompt_token_ids": p} for p in prompts(2, seed=7)]

    def run():
        llm = LLM(model=str(tmp_path), device="cuda", dtype="float16", skip_tokenizer_init=True,
                  num_kv_blocks=64, max_num_seqs=1)
        out = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                          o.outputs[0].token_ids, strict=True)])
               for o in llm.generate(reqs, params)]
        skinny = [m.method.skinny for m in _fp8_layers(llm.engine.executor.model)]
        del llm
        return out, skinny

    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    fp8_out, skinny = run()
    assert skinny and all(skinny) and calls
    monkeypatch.setattr(Fp8Method, "_why_not_fp8", lambda self, layer: "dequantized for the test")
    deq_out, skinny = run()
    assert not any(skinny)
    same = sum(a == b for (ta, _), (tb, _) in zip(fp8_out, deq_out, strict=True) for a, b in zip(ta, tb, strict=True))
    assert same >= 14, (fp8_out, deq_out)  # of 16
    for (ta, la), (tb, lb) in zip(fp8_out, deq_out, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(ta, tb, strict=True)) if a != b), len(ta))
        for a, b in zip(la[:n], lb[:n], strict=True):
            assert abs(a - b) < 0.05


def test_weight_only_kernel_in_the_engine_interpreted():
    """The few-row kernel's place in the engine, on the CPU: in Triton's interpreter (a
    fresh process) the test below runs it for every product of a float32 FP8 model."""
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fp8.py",
                           "-k", "every_product_through_the_kernel"], 900)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_every_product_through_the_kernel(float_model, tmp_path, monkeypatch):
    """With the kernel taking every FP8 product (the row limit raised past a prompt, the
    device check lifted for the interpreter), the engine multiplies the fp8 weights as they
    are, times their scales: greedy tokens and logprobs equal HF on the dequantized float32
    twin (1e-4, as the dequantizing path), the probe at load accepted it for every layer,
    and no layer hands its norm's output over quantized."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("runs in Triton's interpreter (test_weight_only_kernel_in_the_engine_interpreted)")
    from pagedllm.model_executor.layers import skinny_gemm

    monkeypatch.setattr(Fp8Method, "_why_not_fp8", lambda self, layer: None)  # keep the fp8 weights
    monkeypatch.setattr(Fp8Method, "_probe", lambda self, layer: None)  # (no CPU _scaled_mm needed)
    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 4096)
    monkeypatch.setattr(skinny_gemm, "applies_fp8", lambda x, w, s: w.dtype == torch.float8_e4m3fn
                        and s.numel() == w.shape[0] and x.numel() // x.shape[-1] <= skinny_gemm.FP8_MAX_ROWS)
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda *a, **k: calls.append(k.get("scale") is not None)
                        or real(*a, **k))
    _, hf = float_model
    ref = reference_model(hf, write_fp8_checkpoint(hf, str(tmp_path), FP8Spec("compressed-tensors", "channel")))
    llm = LLM(model=str(tmp_path), dtype="float32", **KW)
    layers = _fp8_layers(llm.engine.executor.model)
    assert layers and all(m.method.fp8_matmul and m.method.skinny and m.weight.dtype == torch.float8_e4m3fn
                          for m in layers)
    assert not any(m.takes_fp8_rows(n) for m in layers for n in (1, 64))
    calls.clear()
    assert_parity(llm, ref, prompts(2, seed=7), max_new=4)
    assert calls and all(calls)
