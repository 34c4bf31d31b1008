"""DeepSeek-V2 / V2-Lite / V3 (multi-head latent attention + DeepSeek MoE) generate what
transformers generates (greedy tokens equal, logprobs close) on tiny random models, through
block boundaries, chunked prefill and prefix caching; the page pool holds the latent, not
K and V per head; the absorbed decode equals the decompressed computation."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import DEEPSEEK_VARIANTS as VARIANTS
from hf_models import hf_greedy, save_tiny_deepseek
from paged_batch import latent_batch, paged_meta

from pagedllm import LLM, SamplingParams
from pagedllm.attention.mla import mla_forward
from pagedllm.model_executor.models.deepseek import DeepseekForCausalLM, DeepseekMoe, MlaAttention

MAX_NEW = 6


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            path = str(tmp_path_factory.mktemp(variant))
            cache[variant] = (path, save_tiny_deepseek(path, variant))
        return cache[variant]

    return get


def _prompts(seed: int, n: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(prefix)]
    return [shared + [rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _run(llm: LLM, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    res = [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                   o.outputs[0].token_ids, strict=True)])
           for o in outs]
    return res, [o.num_cached_tokens for o in outs]


_REFERENCE: dict = {}  # (HF model, prompt) -> its greedy tokens and logprobs, computed once


def _matches(results, hf, prompts) -> bool:
    for p, (toks, lps) in zip(prompts, results, strict=True):
        key = (id(hf), tuple(p))
        if key not in _REFERENCE:
            _REFERENCE[key] = hf_greedy(hf, p, MAX_NEW)
        ref_toks, ref_lps = _REFERENCE[key]
        if toks != ref_toks or lps != pytest.approx(ref_lps, abs=1e-4):
            return False
    return True


@pytest.mark.parametrize("variant", ["v2", "v2-lite", "v3"])
def test_parity_chunked_prefill_and_prefix_caching(deepseek, variant):
    """Blocks of 4 tokens, a 24-token budget (prompts of up to 52 tokens prefill in chunks,
    beside decodes), then the same prompts again: their shared 12-token prefix and whole
    prompts come from cached latent pages."""
    path, hf = deepseek(variant)
    prompts = _prompts(1, 3, prefix=12)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=160,
              max_num_batched_tokens=24, enable_prefix_caching=True)
    first, _ = _run(llm, prompts)
    assert _matches(first, hf, prompts)
    again, cached = _run(llm, prompts[::-1])
    assert all(c >= 12 for c in cached)
    for (t1, l1), (t2, l2) in zip(again, first[::-1], strict=True):  # as computed without the cache
        assert t1 == t2
        assert l1 == pytest.approx(l2, abs=1e-5)
    model = llm.engine.executor.model
    moe = [m for m in model.modules() if isinstance(m, DeepseekMoe)]
    assert len(moe) == len(model.model.layers) - hf.config.first_k_dense_replace


def test_routing_and_softmax_scale_are_seen(deepseek):
    """The checks are sharp enough to see V3's correction bias and YaRN's mscale_all_dim
    correction of the softmax scale: without either, the result differs."""
    path, hf = deepseek("v3")
    prompts = _prompts(1, 3, prefix=12)[:2]  # the parity test's: their reference is known
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    model = llm.engine.executor.model
    assert _matches(_run(llm, prompts)[0], hf, prompts)
    biases = [m.gate.e_score_correction_bias for m in model.modules() if isinstance(m, DeepseekMoe)]
    kept = [b.detach().clone() for b in biases]
    with torch.no_grad():
        for b in biases:
            b.zero_()
    assert not _matches(_run(llm, prompts)[0], hf, prompts)
    with torch.no_grad():
        for b, k in zip(biases, kept, strict=True):
            b.copy_(k)
    shape = next(m for m in model.modules() if isinstance(m, MlaAttention)).s  # shared by every layer
    assert shape.scale != pytest.approx((16 + 8) ** -0.5)
    shape.scale = (16 + 8) ** -0.5
    assert not _matches(_run(llm, prompts)[0], hf, prompts)


def test_page_pool_holds_the_latent(deepseek):
    """One tensor a layer of kv_lora_rank + qk_rope_head_dim values a token (the engine),
    and for a DeepSeek-V2-Lite-shaped config about 9x fewer bytes a token than full K and V
    of its 16 heads would take (`pagedllm plan`, no weights loaded). The roofline reads
    the same latent a token."""
    from pagedllm.entrypoints.bench_workloads import DEEPSEEK_V2_LITE_CONFIG, write_arch_config
    from pagedllm.entrypoints.plan import plan_rows

    path, hf = deepseek("v2-lite")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=16)
    runner = llm.engine.executor.runner
    c = hf.config
    assert [tuple(p.shape) for p in runner.kv_caches[0]] == [(16, 4, c.kv_lora_rank + c.qk_rope_head_dim)]
    assert runner.bytes_per_block == 4 * c.num_hidden_layers * (32 + 8) * 4  # float32
    assert llm.engine.core.describe()["kv_bytes_per_token"] == c.num_hidden_layers * 40 * 4

    info, rows = plan_rows(write_arch_config(DEEPSEEK_V2_LITE_CONFIG), kv_cache_memory=1 << 30,
                           load_format="dummy")
    assert info["kv_pages"] == "mla-latent [576] per layer"
    assert 15.6e9 < info["parameters"] < 15.8e9  # the model card's 15.7B: every layer built as the checkpoint's
    bf16 = next(r for r in rows if r.format == "bfloat16")
    assert bf16.kv_bytes_per_token == 27 * (512 + 64) * 2
    full_kv = 27 * 16 * ((128 + 64) + 128) * 2  # K of 192 and V of 128 values, every head
    assert 8.5 < full_kv / bf16.kv_bytes_per_token < 9.5

    from transformers import AutoConfig

    from pagedllm.entrypoints.bench_roofline import model_shape

    cfg = AutoConfig.for_model("deepseek_v2", **{k: v for k, v in DEEPSEEK_V2_LITE_CONFIG.items()
                                                  if k != "model_type"})
    assert model_shape(cfg)["kv"] == 512 + 64


def test_absorbed_decode_equals_decompressed_attention():
    """Decodes (W_UK absorbed into the query, W_UV after the sum over latents) equal the
    same single-token sequences computed as prefill chunks, which decompress the cached
    latents into per-head keys and values."""
    seqs = [(1, 5), (1, 17), (1, 2), (1, 33)]
    cache, args, (tables, slots, q_start, ql, ctx) = latent_batch(seqs, 4, 32, 8, 4, torch.float32)
    outs = []
    for nd in (len(seqs), 0):  # as decodes, then as one-token prefill chunks
        meta = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
        meta.slot_mapping = meta.slot_mapping.long()
        outs.append(mla_forward(cache=cache.clone(), meta=meta, scale=0.3, **args))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_fp8_latent_pages():
    """An fp8 cache stores the latent in e4m3 (scale 1): attention over it equals attention
    over a float cache holding the same rounded values; the pool takes one byte a value."""
    seqs = [(1, 9), (1, 4), (6, 6), (5, 13)]
    cache, args, (tables, slots, q_start, ql, ctx) = latent_batch(seqs, 4, 32, 8, 4, torch.float32)
    args["latent"] = args["latent"].to(torch.float8_e4m3fn).float()  # exactly representable
    fp8 = cache.to(torch.float8_e4m3fn)
    meta = paged_meta(tables, slots, q_start, ql, ctx, 2, 16)
    got = mla_forward(cache=fp8, meta=meta, scale=0.3, **args)
    meta = paged_meta(tables, slots, q_start, ql, ctx, 2, 16)
    want = mla_forward(cache=fp8.float(), meta=meta, scale=0.3, **args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fp8.float().view(-1, 40)[torch.as_tensor(slots)], args["latent"])


def test_unsupported_modes_fail_clearly(deepseek):
    path, hf = deepseek("v2-lite")
    with pytest.raises(NotImplementedError, match="batch-invariant mode has no multi-head latent"):
        LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=16, batch_invariant=True)
    with pytest.raises(ValueError, match="quantized DeepseekV2ForCausalLM checkpoints are not supported"):
        DeepseekForCausalLM(hf.config, "DeepseekV2ForCausalLM", 64, None, quant=object())


def test_tp2_equals_tp1(deepseek):
    """Heads (q, kv_b, o) and experts split over two ranks (gloo on CPU)."""
    path, _ = deepseek("v2")
    prompts = _prompts(3, 2)
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=64, block_size=4)
    want, _ = _run(LLM(path, **kw), prompts)
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        got, _ = _run(llm, prompts)
    finally:
        llm.engine.shutdown()
    for (t1, l1), (t2, l2) in zip(want, got, strict=True):
        assert t1 == t2
        assert l1 == pytest.approx(l2, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_matches_hf_with_and_without_graphs(deepseek, variant):
    """On CUDA in float32: fused MoE kernels, Triton MLA decodes replayed from CUDA graphs
    (and eagerly), prefills decompressing in torch; both agree with transformers."""
    path, hf = deepseek(variant)
    prompts = _prompts(4, 6, prefix=12)
    runs = []
    for eager in (False, True):
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda", num_kv_blocks=256,
                  block_size=16, max_num_batched_tokens=32, enable_prefix_caching=True, enforce_eager=eager,
                  max_num_seqs=16)
        assert (llm.engine.executor.runner.graphs is None) == eager
        for _ in range(2):  # the second time from cached pages
            res, _ = _run(llm, prompts)
            assert _matches(res, hf, prompts)
        runs.append([t for t, _ in res])
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_cuda_bf16_fp8_pages_run(deepseek):
    """bf16 weights over fp8 latent pages: the pool takes half the bytes and greedy
    decoding still follows the float32 reference on its first token."""
    path, hf = deepseek("v2-lite")
    prompts = _prompts(5, 4)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", device="cuda", num_kv_blocks=128,
              kv_cache_dtype="fp8")
    runner = llm.engine.executor.runner
    assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert runner.bytes_per_block == 16 * hf.config.num_hidden_layers * 40
    res, _ = _run(llm, prompts)
    firsts = [t[0] for t, _ in res]
    refs = [hf_greedy(hf, p, 1)[0][0] for p in prompts]
    assert sum(a == b for a, b in zip(firsts, refs, strict=True)) >= 3
