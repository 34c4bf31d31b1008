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


def _neighbour(rng) -> SamplingParams:
    """A random request of one of the kinds a batch may hold."""
    kind = rng.choice(["greedy", "temperature", "top_p", "top_k", "min_p", "penalties",
                       "logit_bias", "seeded", "everything"])
    kw: dict = {"temperature": 0.0 if kind == "greedy" else rng.uniform(0.3, 1.5)}
    if kind in ("top_p", "everything"):
        kw["top_p"] = rng.uniform(0.05, 0.99)
    if kind in ("top_k", "everything"):
        kw["top_k"] = rng.randint(1, 50)
    if kind in ("min_p", "everything"):
        kw["min_p"] = rng.uniform(0.01, 0.5)
    if kind in ("penalties", "everything"):
        kw.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                  repetition_penalty=rng.uniform(0.5, 2.0))
    if kind in ("logit_bias", "everything"):
        kw["logit_bias"] = {rng.randrange(1000): rng.uniform(-100, 100) for _ in range(3)}
    if kind == "seeded":
        kw["seed"] = rng.randrange(1 << 30)
    return SamplingParams(**kw)


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.8, seed=123),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7),
    SamplingParams(temperature=0.7, top_k=40, min_p=0.02, seed=99),
    SamplingParams(temperature=1.2, presence_penalty=0.5, repetition_penalty=1.2, seed=5),
    SamplingParams(temperature=0, seed=1),
], ids=["temperature", "top_p", "top_k+min_p", "penalties", "greedy"])
def test_a_seeded_row_is_sampled_alike_whatever_its_neighbours(target):
    """The sampler alone (the model's logits held fixed): a seeded row's draws over many
    steps are the same alone and beside random neighbours of every kind, in any position,
    with a vocabulary large enough (49152, SmolLM2's) for float32 sums to drift."""
    import random

    import torch

    from pagedllm.model_executor.layers.sampler import Sampler
    from pagedllm.worker.model_runner import ModelRunner, _ReqState

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    sampler = Sampler(torch.Generator().manual_seed(0))
    vocab, steps, rng = 49152, 12, random.Random(0)
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(vocab, generator=gen) * 4 for _ in range(steps)]
    history = list(range(50, 80))  # prompt and output so far, for the penalties

    def draws(neighbours: list[SamplingParams], pos: int) -> list[int]:
        params = neighbours[:pos] + [target] + neighbours[pos:]
        states = [_ReqState(token_ids=list(history), num_prompt=10, params=p,
                            generator=(torch.Generator().manual_seed(p.seed)
                                       if p.seed is not None else None)) for p in params]
        out = []
        for step in range(steps):
            rows = torch.stack([logits[step]] + [torch.randn(vocab, generator=gen) * 4
                                                 for _ in neighbours])
            rows = torch.cat([rows[1:pos + 1], rows[:1], rows[pos + 1:]])  # target at pos
            b = runner._sampling_batch(states, vocab)
            out.append(int(sampler.sample(rows, b).token_ids[pos]))
        return out

    alone = draws([], 0)
    assert len(set(alone)) > 1 or target.temperature == 0  # really sampling
    for trial in range(15):
        neighbours = [_neighbour(rng) for _ in range(rng.randint(1, 6))]
        pos = rng.randint(0, len(neighbours))
        assert draws(neighbours, pos) == alone, (trial, neighbours)


def test_settings_a_row_does_not_use_leave_it_untouched():
    """The batch fills the top-p of rows without one with 1.0, top-k with the vocabulary
    size, min-p with 0 and penalties with no-ops: each must leave such a row's logits
    bit for bit as they were. (A float32 cumsum over 49152 probabilities ends above 1.0, so
    a plain `mass above > top_p` test cut thousands of tail tokens from rows at 1.0.)"""
    import torch

    from pagedllm.model_executor.layers.sampler import (
        SamplingBatch,
        apply_penalties,
        apply_top_k_top_p_min_p,
    )

    vocab = 49152
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 4
    b = SamplingBatch(temperature=torch.ones(4), top_k=torch.tensor([vocab, 20, vocab, vocab]),
                      top_p=torch.tensor([1.0, 1.0, 0.5, 1.0]),
                      min_p=torch.tensor([0.0, 0.0, 0.0, 0.1]),
                      presence=torch.tensor([0.0, 0.5, 0.0, 0.0]),
                      frequency=torch.tensor([0.0, 0.2, 0.0, 0.0]),
                      repetition=torch.tensor([1.0, 1.3, 1.0, 1.0]),
                      output_counts=torch.randint(0, 3, (4, vocab)).float(),
                      seen_mask=torch.rand(4, vocab) < 0.1)
    out = apply_top_k_top_p_min_p(apply_penalties(logits, b), b)
    assert torch.equal(out[0], logits[0])  # row 0 uses nothing
    for r in (1, 2, 3):  # the others really were cut
        assert torch.isinf(out[r]).sum() > vocab // 2


def test_fused_sampler_kernels_interpreted():
    """tests/test_fused_sampler.py in Triton's interpreter (CI has no GPU)."""
    pytest.importorskip("triton")
    from interpreted import run_interpreted

    # less the bf16-logits test, which needs CUDA's bf16 (it runs on the GPU)
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fused_sampler.py",
                           "-k", "not low_precision_logits"], 600)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
    assert "skipped" not in res.stdout.splitlines()[-1], res.stdout[-500:]
