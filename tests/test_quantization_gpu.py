"""The Triton W4A16 kernel equals dequantize-then-matmul, and quantized checkpoints run on
CUDA with their weights still packed. Skipped without a GPU; run on the lent H200:

    python -m pytest -q tests/test_quantization_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from w4a16_reference import check_kernel, random_layer

from pagedllm.model_executor.layers.quantization.packing import dequantize, tile_rows

pytestmark = pytest.mark.gpu


def test_tiled_layout_round_trip():
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw

    for bits, k in ((4, 4096), (4, 200), (8, 1000), (2, 512)):
        t, gs = random_layer(k, 48, 64 if k % 64 == 0 else -1, bits, 0, False, seed=k)
        tiled = tile_rows(t["qweight"], bits, tw.tile_k_for(bits))
        plain = dequantize(t["qweight"], t["qzeros"], t["scales"], gs, bits, 0)
        assert torch.equal(dequantize(tiled, t["qzeros"], t["scales"], gs, bits, 0, None, torch.float32,
                                      tw.tile_k_for(bits), k), plain)


@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (4096, 1376), (2752, 1024)])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_kernel_matches_dequantized_matmul(m, k, n, group_size, act_order):
    if group_size == -1 or k % group_size == 0:
        check_kernel(m, k, n, group_size, act_order, seed=m + k + n + group_size)
    else:
        pytest.skip("K not a multiple of the group size")


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16, 100, 256])
@pytest.mark.parametrize(("bits", "zero_offset", "dtype"), [
    (4, 0, torch.float16), (4, 1, torch.float32), (8, 1, torch.bfloat16), (8, 0, torch.float16),
    (2, 0, torch.bfloat16),
])
def test_kernel_bits_zero_offsets_dtypes(m, bits, zero_offset, dtype):
    check_kernel(m, 1024, 528, 128, act_order=m % 2 == 1, bits=bits, zero_offset=zero_offset, dtype=dtype, seed=m)


@pytest.mark.parametrize("m", [3, 33])
@pytest.mark.parametrize("group_size", [48, 128])
def test_kernel_partial_last_group_and_odd_sizes(m, group_size):
    """K not a multiple of the group (the last group is short) nor of the kernel's tile,
    N not a multiple of the block, a group size that is only a multiple of 16."""
    check_kernel(m, 800, 72, group_size, act_order=m > 10, dtype=torch.float16)


def test_quantized_layer_stays_packed_on_cuda(tiny_models, tmp_path):
    """The layer computes with the kernel: no float copy of the weight is kept on CUDA."""
    from hf_models import save_tiny_model
    from quant_packers import GPTQSpec, reference_model, write_quantized_checkpoint

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.layers.linear import LinearBase
    from pagedllm.model_executor.layers.quantization import triton_w4a16 as tw
    from pagedllm.model_executor.layers.quantization.gptq_awq import PackedMethod

    hf = save_tiny_model(str(tmp_path / "float"), "llama", hidden_size=128, intermediate_size=256)
    spec = GPTQSpec(group_size=32, sym=False, act_order=True)
    ref = reference_model(hf, write_quantized_checkpoint(hf, str(tmp_path / "q"), spec)).cuda()
    calls = []
    real = tw.wna16_matmul

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    tw.wna16_matmul = spy
    try:
        llm = LLM(model=str(tmp_path / "q"), skip_tokenizer_init=True, dtype="float32", device="cuda",
                  block_size=16, num_kv_blocks=64)
        prompts = [[1, 5, 9, 200, 3, 7, 42], [11, 12, 13]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True))
    finally:
        tw.wna16_matmul = real
    assert calls, "the Triton kernel was not used"
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, LinearBase) and m.quant is not None]
    assert layers and all(isinstance(m.method, PackedMethod) and m.method._dequantized is None
                          and m.qweight.dtype == torch.int32 and m.method.tile_k for m in layers)
    for p, o in zip(prompts, outs, strict=True):
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        toks = gen.sequences[0, len(p):].tolist()
        assert o.outputs[0].token_ids == toks
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, toks, strict=True)]
        got = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, toks, strict=True)]
        assert got == pytest.approx(lps, abs=1e-2)  # HF's CUDA attention/matmuls differ slightly


def test_bf16_dummy_model_runs_quantized(tmp_path):
    """A whole model with random packed weights (the benchmark's path) runs in bf16."""
    import json

    from hf_models import make_config

    from pagedllm import LLM, SamplingParams

    cfg = make_config("llama", hidden_size=256, intermediate_size=512).to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(tmp_path), load_format="dummy", quantization="awq", dtype="bfloat16", device="cuda",
              skip_tokenizer_init=True, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
