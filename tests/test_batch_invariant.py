"""Batch-invariant mode: a request's logits, logprobs and tokens are the same bits alone or
in any batch, with its prompt chunked or not and its prefix cached or not; and they are
still the model's (greedy tokens equal transformers' on a tiny random model)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import hf_greedy

from pagedllm import LLM, SamplingParams, batch_invariant
from pagedllm.attention.batch_invariant import BatchInvariantAttention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_backend import TorchPagedAttention
from pagedllm.config import EngineConfig


def test_tiled_linear_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g)
    x = torch.randn(70, 64, generator=g)
    ref = batch_invariant.tiled_linear(x[3:4], w, b)
    for m in (1, 2, 5, 15, 16, 17, 33, 70):
        rows = torch.cat([x[:m], x[3:4]]) if m <= 3 else x[:m]
        at = m if m <= 3 else 3
        assert torch.equal(batch_invariant.tiled_linear(rows, w, b)[at], ref[0]), m
    torch.testing.assert_close(batch_invariant.tiled_linear(x, w, b), F.linear(x, w, b))


def test_elementwise_is_the_function_itself():
    x = torch.randn(3, 1537)
    with batch_invariant.enabled(True):
        y = batch_invariant.elementwise(F.silu, x)
    torch.testing.assert_close(y, F.silu(x), rtol=1e-6, atol=1e-6)
    assert y.shape == x.shape


def _paged_batch(seqs, bs=16, hkv=2, hq=4, d=16, seed=0):
    """A flat batch over a paged cache: seqs = [(context length, query length)], decodes
    first. The cache holds random keys for the cached part; forward writes the rest."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-c // bs) for c, _ in seqs) + 4
    k_cache = torch.randn(nb, bs, hkv, d, generator=g)
    v_cache = torch.randn(nb, bs, hkv, d, generator=g)
    width = max(-(-c // bs) for c, _ in seqs)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    used, slots, q_start = 0, [], []
    for i, (c, ql) in enumerate(seqs):
        blocks = -(-c // bs)
        tables[i, :blocks] = perm[used:used + blocks]
        used += blocks
        q_start.append(len(slots))
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(c - ql, c)]
    ctx = np.asarray([c for c, _ in seqs])
    ql = np.asarray([q for _, q in seqs])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode=int((ql == 1).sum()), block_tables=tables,
        q_start=torch.tensor(q_start, dtype=torch.int32), q_len=torch.from_numpy(ql).int(),
        ctx_len=torch.from_numpy(ctx).int(), host_q_start=np.asarray(q_start), host_q_len=ql,
        host_ctx_len=ctx)
    t = len(slots)
    q = torch.randn(t, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("window,alibi", [(None, False), (20, False), (None, True)],
                         ids=["causal", "sliding-window", "alibi"])
def test_attention_equals_the_reference_backend(window, alibi):
    seqs = [(37, 1), (130, 1), (5, 1), (70, 70), (150, 40), (200, 3)]
    q, k, v, kc, vc, meta = _paged_batch(seqs)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25, slopes, window)
    out = BatchInvariantAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25, slopes, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 20], ids=["causal", "sliding-window"])
def test_attention_with_sinks_equals_the_reference_backend(window):
    """gpt-oss's attention sinks (a logit per head in each softmax's denominator)."""
    seqs = [(37, 1), (130, 1), (70, 70), (150, 40)]
    q, k, v, kc, vc, meta = _paged_batch(seqs, seed=1)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    ref = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25, None, window, sinks=sinks)
    out = BatchInvariantAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25, None, window, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = TorchPagedAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25, None, window)
    assert not torch.allclose(plain, ref, rtol=1e-3, atol=1e-3)


def test_attention_of_a_query_does_not_depend_on_its_batch():
    """The last query of a 150-token context: alone as a decode, as the last row of a
    40-row chunk, and beside other sequences: the same bits."""
    q, k, v, kc, vc, meta = _paged_batch([(150, 40)], seed=3)
    whole = BatchInvariantAttention.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25)
    q1, k1, v1, kc1, vc1, meta1 = _paged_batch([(150, 40)], seed=3)
    # The same cache with the chunk's first 39 tokens already written: then one decode.
    BatchInvariantAttention.write_kv(k1[:39], v1[:39], kc1, vc1, meta1.slot_mapping[:39])
    dmeta = AttentionMetadata(
        slot_mapping=meta1.slot_mapping[39:], num_decode=1, block_tables=meta1.block_tables,
        q_start=torch.zeros(1, dtype=torch.int32), q_len=torch.ones(1, dtype=torch.int32),
        ctx_len=meta1.ctx_len, host_q_start=np.zeros(1, dtype=np.int64),
        host_q_len=np.ones(1, dtype=np.int64), host_ctx_len=meta1.host_ctx_len)
    alone = BatchInvariantAttention.forward(q1[39:], k1[39:], v1[39:], kc1, vc1, dmeta, 0.25)
    assert torch.equal(alone[0], whole[39])


def test_the_engine_setting_resolves_from_the_environment(monkeypatch):
    from hf_models import make_config

    cfg = make_config("llama")
    monkeypatch.setenv("PAGEDLLM_BATCH_INVARIANT", "1")
    assert EngineConfig(model="x").resolve(cfg, False).batch_invariant is True
    assert EngineConfig(model="x", batch_invariant=False).resolve(cfg, False).batch_invariant is False
    monkeypatch.delenv("PAGEDLLM_BATCH_INVARIANT")
    assert EngineConfig(model="x").resolve(cfg, False).batch_invariant is False


def _prompts(n: int, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(1, 256) for _ in range(rng.randint(3, 90))]
            for _ in range(n)]


def _record(out) -> tuple:
    """Everything a request returned, as exact values."""
    o = out.outputs[0]
    lps = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in o.logprobs]
    plp = [None if d is None else sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
           for d in out.prompt_logprobs]
    return o.token_ids, lps, plp


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engines(request, tiny_models):
    """Two batch-invariant engines on one tiny model: one computes each prompt whole, the
    other in chunks of 32 tokens with the prefix cache on and few KV blocks."""
    path, hf = tiny_models(request.param)
    whole = LLM(model=path, skip_tokenizer_init=True, batch_invariant=True, block_size=16,
                num_kv_blocks=512, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = LLM(model=path, skip_tokenizer_init=True, batch_invariant=True, block_size=16,
                  num_kv_blocks=512, max_num_batched_tokens=32, enable_prefix_caching=True)
    return hf, whole, chunked


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)


def test_greedy_tokens_equal_transformers(engines):
    hf, whole, chunked = engines
    prompts = _prompts(4, seed=1)
    for llm in (whole, chunked):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        for p, o in zip(prompts, outs, strict=True):
            toks, lps = hf_greedy(hf, p, 8)
            assert o.outputs[0].token_ids == toks
            got = [d[t].logprob for d, t in zip(o.outputs[0].logprobs, toks, strict=True)]
            np.testing.assert_allclose(got, lps, rtol=1e-4, atol=1e-4)


def _assert_alone_equals_batched(whole: LLM, chunked: LLM) -> None:
    """64 prompts (half of them sharing a 40-token prefix: cached after the first), each
    alone on `whole` against random batches of 1, 3, 17 and 64 on `chunked`."""
    shared = _prompts(1, seed=7)[0][:40]
    prompts = _prompts(32, seed=2) + _prompts(32, seed=3, prefix=shared)
    alone = {i: _record(whole.generate([{"prompt_token_ids": prompts[i]}], GREEDY)[0])
             for i in range(len(prompts))}
    rng = random.Random(5)
    for size in (1, 3, 17, 64):
        picks = rng.sample(range(len(prompts)), size)
        outs = chunked.generate([{"prompt_token_ids": prompts[i]} for i in picks], GREEDY)
        for i, o in zip(picks, outs, strict=True):
            assert _record(o) == alone[i], (size, i)


def test_logprobs_are_bitwise_the_same_in_any_batch(engines):
    """Each prompt alone on the whole-prompt engine against batches of 1..64 on the
    chunked, prefix-cached one (a shared prefix half the batch: cached after the first)."""
    _, whole, chunked = engines
    _assert_alone_equals_batched(whole, chunked)


def _neighbour(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["greedy", "temperature", "top_p", "top_k", "min_p", "penalties",
                       "logit_bias", "seeded"])
    kw: dict = {"max_tokens": rng.randint(1, 12), "temperature": 0.0 if kind == "greedy" else 0.9}
    kw.update({"top_p": {"top_p": 0.8}, "top_k": {"top_k": 5}, "min_p": {"min_p": 0.1},
               "penalties": {"presence_penalty": 0.5, "repetition_penalty": 1.3},
               "logit_bias": {"logit_bias": {7: 5.0}}, "seeded": {"seed": rng.randrange(99)},
               }.get(kind, {}))
    return SamplingParams(**kw)


def test_a_seeded_request_is_the_same_beside_every_kind_of_neighbour(engines):
    _, whole, chunked = engines
    target = SamplingParams(temperature=0.8, seed=123, n=2, max_tokens=12, ignore_eos=True,
                            logprobs=2)
    prompt = {"prompt_token_ids": _prompts(1, seed=11)[0]}
    alone = whole.generate([prompt], target)[0]
    rng = random.Random(0)
    for _ in range(6):
        neighbours = [_neighbour(rng) for _ in range(rng.randint(1, 5))]
        others = [{"prompt_token_ids": p} for p in _prompts(len(neighbours), rng.randrange(99))]
        pos = rng.randint(0, len(others))
        outs = chunked.generate(others[:pos] + [prompt] + others[pos:],
                                neighbours[:pos] + [target] + neighbours[pos:])
        got = outs[pos]
        for a, b in zip(alone.outputs, got.outputs, strict=True):
            assert a.token_ids == b.token_ids, neighbours
            assert a.logprobs == b.logprobs


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_cuda_bf16_logprobs_are_bitwise_the_same_in_any_batch(tiny_models, arch):
    """On CUDA in bfloat16, decode steps replayed from CUDA graphs (the fixed-tile Triton
    matmul, one attention tile shape for decodes and prefills, the fused MoE at one
    configuration): alone, on an engine that computes prompts whole, against batches of
    1..64 on one that chunks them and caches prefixes."""
    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True) if arch == "qwen3_moe" else {}
    path, _ = tiny_models(arch, **extra)
    kw = dict(model=path, skip_tokenizer_init=True, batch_invariant=True, dtype="bfloat16",
              device="cuda", block_size=16, num_kv_blocks=1024)
    whole = LLM(**kw, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = LLM(**kw, max_num_batched_tokens=32, enable_prefix_caching=True)
    assert chunked.engine.executor.runner.graphs is not None
    _assert_alone_equals_batched(whole, chunked)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matmul_is_right_and_row_invariant(dtype):
    from pagedllm.batch_invariant_cuda import matmul

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1000, 576, generator=g, device="cuda").to(dtype)
    x = torch.randn(300, 576, generator=g, device="cuda").to(dtype)
    y = matmul(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-1)
    for m in (1, 2, 7, 64, 129):
        assert torch.equal(matmul(x[:m], w), y[:m]), m
