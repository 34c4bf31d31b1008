"""The fp8 (e4m3) KV cache: pages hold k / k_scale and v / v_scale in one byte; attention
over them equals attention over the same quantized values held in full precision, in the
torch reference and the Triton kernels; the engine on a tiny model stays close to its
full-precision self and fits four times the tokens of a float32 cache in the same memory;
per-layer scales come from the checkpoint when it has them."""

from __future__ import annotations

import os

import pytest
import torch
from paged_batch import paged_batch, paged_meta

from pagedllm import LLM, SamplingParams
from pagedllm.attention.torch_backend import TorchPagedAttention, quantize_fp8

FP8 = torch.float8_e4m3fn


def _qdq(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 page gives back: x / scale rounded to e4m3, times scale."""
    return quantize_fp8(x, scale).float() * scale


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.5, 2.0)])
def test_torch_attention_over_fp8_pages_equals_the_quantized_values(k_scale, v_scale):
    q, k, v, kc, vc, tables, slots, q_start, ql, ctx, nd = paged_batch(
        [(1, 5), (1, 64), (40, 40), (7, 100)], 8, 2, 64, 16, torch.float32, seed=1)
    meta = paged_meta(tables, slots, q_start, ql, ctx, nd, 16)
    fp8_k, fp8_v = quantize_fp8(kc, k_scale), quantize_fp8(vc, v_scale)
    got = TorchPagedAttention.forward(q, k, v, fp8_k, fp8_v, meta, 0.125, k_scale=k_scale,
                                      v_scale=v_scale)
    want = TorchPagedAttention.forward(q, _qdq(k, k_scale), _qdq(v, v_scale), _qdq(kc, k_scale),
                                       _qdq(vc, v_scale), meta, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # what was written is k / k_scale in e4m3
    row = int(meta.slot_mapping[0])
    stored = fp8_k.view(-1, 2, 64)[row].float()
    assert torch.equal(stored, quantize_fp8(k[0], k_scale).float())


def _prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(5, 60))] for _ in range(n)]


def test_the_engine_with_an_fp8_cache_stays_close_to_full_precision(tiny_models):
    """Teacher-forced, so that one flipped near-tie does not send the rest elsewhere: the
    same token sequences scored by both engines (prompt logprobs, read back from the
    cache). e4m3 keeps 3 mantissa bits (a relative error up to 1/16 per element); on this
    tiny model with wide random weights (logprobs around -3) a position's token moves by
    0.07 on average and at most about 0.4, and the most likely token mostly stays the
    same. The pool holds 4x the tokens of a float32 cache in the same memory."""
    path, _ = tiny_models("llama")
    kw = dict(model=path, skip_tokenizer_init=True, block_size=16, kv_cache_memory="2MiB", device="cpu")
    full = LLM(**kw)
    fp8 = LLM(**kw, kv_cache_dtype="fp8")
    assert fp8.engine.describe()["kv_tokens"] == 4 * full.engine.describe()["kv_tokens"]
    assert fp8.engine.executor.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(
        _prompts(6, seed=2), full.generate([{"prompt_token_ids": p} for p in _prompts(6, seed=2)],
                                           greedy), strict=True)]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    a = full.generate([{"prompt_token_ids": s} for s in seqs], score)
    b = fp8.generate([{"prompt_token_ids": s} for s in seqs], score)
    deltas, same_top = [], []
    for s, x, y in zip(seqs, a, b, strict=True):
        for pos in range(1, len(s)):
            px, py = x.prompt_logprobs[pos], y.prompt_logprobs[pos]
            deltas.append(abs(px[s[pos]].logprob - py[s[pos]].logprob))
            same_top.append(min(px, key=lambda t: px[t].rank) == min(py, key=lambda t: py[t].rank))
    assert max(deltas) < 0.5 and sum(deltas) / len(deltas) < 0.1, (max(deltas), sum(deltas) / len(deltas))
    assert 0 < sum(deltas)  # the cache really is quantized
    assert sum(same_top) >= 0.8 * len(same_top), (sum(same_top), len(same_top))


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("k_proj.k_scale", "v_proj.v_scale")],
                         ids=["compressed-tensors", "modelopt"])
def test_kv_scales_come_from_the_checkpoint(tiny_models, tmp_path, names):
    """compressed-tensors' kv_cache_scheme writes `self_attn.k_scale` / `v_scale` per layer,
    ModelOpt `self_attn.k_proj.k_scale` / `v_proj.v_scale`: they are loaded, and the pages
    hold k / k_scale."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = tiny_models("llama")
    dst = tmp_path / "scaled"
    shutil.copytree(path, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    for layer in range(2):
        weights[f"model.layers.{layer}.self_attn.{names[0]}"] = torch.tensor(0.25)
        weights[f"model.layers.{layer}.self_attn.{names[1]}"] = torch.tensor(4.0)
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model=str(dst), skip_tokenizer_init=True, block_size=16, num_kv_blocks=32,
              kv_cache_dtype="fp8", device="cpu")
    attn = llm.engine.executor.runner.model.model.layers[0].self_attn
    assert (attn.k_scale, attn.v_scale) == (0.25, 4.0)
    plain = LLM(model=str(dst), skip_tokenizer_init=True, block_size=16, num_kv_blocks=32, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=1)
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    llm.generate([prompt], params)
    plain.generate([prompt], params)
    # the first four slots of layer 0: fp8 pages of k / 0.25 vs the float cache's k
    page = llm.engine.executor.runner.kv_caches[0][0].view(-1, *plain.engine.executor.runner.kv_caches[0][0].shape[-2:])
    ref = plain.engine.executor.runner.kv_caches[0][0].view(page.shape)
    used = [s for s in range(page.shape[0]) if ref[s].abs().sum() > 0]
    assert len(used) == 4
    for s in used:
        torch.testing.assert_close(page[s].float() * 0.25, ref[s], rtol=0.07, atol=1e-3)


def test_plan_counts_fp8_pages(tiny_models):
    from pagedllm.entrypoints.plan import plan_rows

    path, _ = tiny_models("llama")
    _, auto = plan_rows(path, kv_cache_memory=1 << 20)
    info, fp8 = plan_rows(path, kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    assert info["kv_cache_dtype"] == "fp8"
    per_token = 2 * info["layers"] * info["kv_heads"] * info["head_dim"]  # K and V, one byte
    for a, b in zip(auto, fp8, strict=True):
        assert b.kv_bytes_per_token == per_token < a.kv_bytes_per_token
        assert b.kv_tokens > a.kv_tokens


def test_fp8_pages_give_the_same_tokens_chunked_and_prefix_cached(tiny_models):
    """Every attention reads the quantized pages (a chunk's own keys too), so splitting a
    prompt into chunks or taking its prefix from the cache changes nothing: greedy tokens
    and prompt logprobs equal those of whole prompts with no cache."""
    path, _ = tiny_models("llama")
    kw = dict(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, kv_cache_dtype="fp8",
              device="cpu")
    whole = LLM(**kw, enable_prefix_caching=False)
    split = LLM(**kw, enable_prefix_caching=True, max_num_batched_tokens=16)
    prompts = _prompts(4, seed=5)
    prompts += [prompts[0] + [7, 8, 9]]  # a prefix of an earlier prompt, in the cache
    scored = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    want = whole.generate([{"prompt_token_ids": p} for p in prompts], scored)
    got = split.generate([{"prompt_token_ids": p} for p in prompts], scored)  # chunked
    for x, y in zip(want, got, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            (ta,) = a
            assert abs(a[ta].logprob - b[ta].logprob) < 1e-4
    # Prompt logprobs bypass the prefix cache; plain requests read the cached blocks.
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for _ in range(2):
        got = split.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert split.engine.stats().prefix_hits > 0
