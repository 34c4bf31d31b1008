"""Sampling settings do what they say, per request, in a mixed batch."""

from __future__ import annotations

import math

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    path, _ = tiny_models("llama")
    return LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, seed=0)


P = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    ("prompt_logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_bad_token_ids_rejected(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([{"prompt_token_ids": [1, 10_000]}])
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(P, SamplingParams(logit_bias={10_000: 1.0}))
    assert not llm.engine.has_unfinished_requests()


def test_seeded_request_is_independent_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(P, seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(20, 26)]
    mixed = llm.generate(P + others, [seeded] + [SamplingParams(temperature=1.0, max_tokens=12)] * 6)
    assert mixed[0].outputs[0].token_ids == alone
    greedy = llm.generate(P, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids != alone  # it really sampled


def test_unseeded_sampling_varies_and_engine_seed_repeats(tiny_models):
    path, _ = tiny_models("llama")
    params = SamplingParams(temperature=1.0, max_tokens=10, n=4, ignore_eos=True)
    a = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=128, seed=7).generate(P, params)[0]
    b = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=128, seed=7).generate(P, params)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(P, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    topk = llm.generate(P, SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True))
    assert topk[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_tiny_top_p_and_high_min_p_equal_greedy(llm):
    greedy = llm.generate(P, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for params in (SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True)):
        assert llm.generate(P, params)[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logit_bias_forces_a_token(llm):
    out = llm.generate(P, SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}, ignore_eos=True))
    assert out[0].outputs[0].token_ids == [42] * 5


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate(P, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    stop_tok = free.token_ids[2]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(P, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens masks the stop token until enough tokens exist.
    out = llm.generate(P, SamplingParams(temperature=0, max_tokens=8, min_tokens=6,
                                         stop_token_ids=[stop_tok]))[0].outputs[0]
    assert stop_tok not in out.token_ids[:6]
    assert len(out.token_ids) >= 6


def test_repetition_penalties_change_output(llm):
    base = llm.generate(P, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert len(set(base.token_ids)) < 16  # the tiny model repeats itself
    for kw in ({"repetition_penalty": 5.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        pen = llm.generate(P, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw))[0].outputs[0]
        assert len(set(pen.token_ids)) > len(set(base.token_ids)), kw


def test_logprobs_are_normalised_and_ranked(llm):
    out = llm.generate(P, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=5,
                                         ignore_eos=True))[0].outputs[0]
    total = 0.0
    for pos, tok in zip(out.logprobs, out.token_ids, strict=True):
        assert tok in pos
        ranked = sorted((lp for t, lp in pos.items() if lp.rank <= 5), key=lambda x: x.rank)
        assert [x.rank for x in ranked] == [1, 2, 3, 4, 5]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:], strict=False))
        assert sum(math.exp(x.logprob) for x in ranked) <= 1.0 + 1e-5
        total += pos[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_max_tokens_none_runs_to_context_limit(tiny_models):
    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=24)
    out = llm.generate(P, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 24 - 5
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="context length"):
        llm.generate([{"prompt_token_ids": list(range(30))}])


def test_sampler_draws_follow_the_distribution():
    """Frequencies over many rows match the softmax; masked tokens are never drawn."""
    import torch

    from pagedllm.model_executor.layers.sampler import Sampler, SamplingBatch

    n = 20000
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = probs.log().repeat(n, 1)
    sampler = Sampler(torch.Generator().manual_seed(1))
    batch = SamplingBatch(temperature=torch.ones(n), generators=[None] * n, num_logprobs=[None] * n)
    freq = torch.bincount(torch.tensor(sampler(logits, batch).token_ids), minlength=4).float() / n
    assert freq[1] == 0
    assert torch.allclose(freq, probs, atol=0.015)
