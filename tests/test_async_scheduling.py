"""Async scheduling (step N+1 launched before step N is read) gives exactly what the
in-step engine gives: same tokens, logprobs, finish reasons, and every block back.

On CPU the device work is not overlapped, but the engine's part is the same: requests are
scheduled with their last token still unread, and the runner takes that token from the
previous step's device tensor."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

POISON = 77


def make(path: str, async_scheduling: bool, **kw) -> LLM:
    kw = {"block_size": 4, "num_kv_blocks": 256, "seed": 0, **kw}
    return LLM(model=path, skip_tokenizer_init=True, async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def pair(tiny_models):
    path, _ = tiny_models("llama")
    return make(path, False), make(path, True)


def prompts(k: int, base: int = 3) -> list[dict]:
    return [{"prompt_token_ids": [(base + 7 * i + j) % 250 + 1 for j in range(3 + i % 9)]} for i in range(k)]


def summary(outs) -> list:
    return [[(o.token_ids, o.finish_reason, o.stop_reason,
              [sorted(d.items()) for d in o.logprobs] if o.logprobs else None) for o in r.outputs]
            for r in outs]


def assert_same(a, b, tol: float = 1e-5) -> None:
    sa, sb = summary(a), summary(b)
    for ra, rb in zip(sa, sb, strict=True):
        for (ta, fa, stop_a, la), (tb, fb, stop_b, lb) in zip(ra, rb, strict=True):
            assert (ta, fa, stop_a) == (tb, fb, stop_b)
            assert (la is None) == (lb is None)
            for da, db in zip(la or [], lb or [], strict=True):
                assert [t for t, _ in da] == [t for t, _ in db]
                assert all(abs(x.logprob - y.logprob) < tol for (_, x), (_, y) in zip(da, db, strict=True))


def test_async_is_on_only_where_asked_on_cpu(pair):
    sync, asyn = pair
    assert not sync.engine.async_scheduling and asyn.engine.async_scheduling


def test_mixed_sampling_matches_the_in_step_engine(pair):
    """Greedy, seeded, logprobs, n>1, stop tokens with min_tokens, and lengths that end
    on different steps, all in one batch."""
    params = [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=9, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_tokens=25, ignore_eos=True),
    ]
    ps = prompts(20)
    plist = [params[i % len(params)] for i in range(len(ps))]
    ref = pair[0].generate(ps, plist)
    got = pair[1].generate(ps, plist)
    assert_same(ref, got)
    # A stop token that the greedy output really contains: the request stops there, and
    # the token sampled past it by the step already in flight is never seen.
    tokens = ref[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=17, stop_token_ids=[tokens[5]], min_tokens=2)
    a, b = pair[0].generate(ps[:1], stop), pair[1].generate(ps[:1], stop)
    assert_same(a, b)
    assert b[0].outputs[0].finish_reason == "stop" and len(b[0].outputs[0].token_ids) < 17
    for llm in pair:
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
        assert not llm.engine.has_unfinished_requests()


def test_penalties_run_in_step_next_to_async_requests(pair):
    ps = prompts(6, base=40)
    plist = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            repetition_penalty=1.3 if i % 2 else 1.0, presence_penalty=0.5 if i % 3 == 0 else 0.0)
             for i in range(6)]
    assert_same(pair[0].generate(ps, plist), pair[1].generate(ps, plist))
    assert not pair[1].engine.core._penalized


def test_preemption_and_chunked_prefill_match(tiny_models):
    """A pool too small for the batch: requests are preempted with a token in flight and
    resumed from their prompt plus every token they got."""
    path, _ = tiny_models("llama")
    kw = {"num_kv_blocks": 24, "max_num_batched_tokens": 16, "enable_prefix_caching": True}
    sync, asyn = make(path, False, **kw), make(path, True, **kw)
    ps = prompts(12, base=90)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    ref = sync.generate(ps, params)
    got = asyn.generate(ps, params)
    assert asyn.engine.scheduler.num_preemptions_total > 0
    assert_same(ref, got)
    assert asyn.engine.kv.num_free_blocks == asyn.engine.kv.num_blocks
    again = asyn.generate(ps, params)  # now with cached prefixes
    assert asyn.engine.kv.prefix_hits > 0
    assert_same(ref, again)


def test_abort_with_a_step_in_flight(pair):
    sync, asyn = pair
    eng = asyn.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ps = prompts(4, base=150)
    ref = sync.generate(ps, params)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", None, p["prompt_token_ids"], params)
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == 3:
            assert eng.core._inflight is not None
            with pytest.raises(ValueError, match="in use"):  # aborted, but its step still runs
                eng.add_request("r1", None, [1, 2], params)
            eng.abort_request("r1")
            with pytest.raises(ValueError, match="in use"):
                eng.add_request("r1", None, [1, 2], params)
    assert set(done) == {"r0", "r2", "r3"}
    for i in (0, 2, 3):
        assert done[f"r{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    eng.add_request("r1", None, [1, 2], params)  # free once nothing of it runs
    assert eng.abort_request("r1") is not None


def test_non_finite_logits_fail_one_request_alone(tiny_models, monkeypatch):
    path, _ = tiny_models("llama")
    # eager: on CUDA the decode graphs would replay the forward captured before the patch
    sync, asyn = make(path, False), make(path, True, enforce_eager=True)
    ps = prompts(5, base=200)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = sync.generate(ps, params)
    model = asyn.engine.executor.model
    forward = model.forward

    def poisoned(ids, *args):
        hidden = forward(ids, *args)
        if hidden.shape[0] != ids.shape[0]:  # only the sampled rows came back (meta.keep_rows)
            ids = ids.index_select(0, args[-1].keep_rows)
        return hidden.masked_fill((ids == POISON)[:, None], float("nan"))

    monkeypatch.setattr(model, "forward", poisoned)
    # Its second token is forced to POISON: the step that feeds it back fails it, after
    # the next step has already been launched with it.
    bias = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={POISON: 100.0})
    outs = asyn.generate(ps + [{"prompt_token_ids": [9, 8, 7]}], [params] * 5 + [bias])
    assert [o.outputs[0].token_ids for o in outs[:5]] == [o.outputs[0].token_ids for o in ref]
    assert outs[5].outputs[0].finish_reason == "error" and "non-finite" in outs[5].error
    assert asyn.engine.kv.num_free_blocks == asyn.engine.kv.num_blocks


@pytest.mark.parametrize("trial", range(5))
def test_random_workloads_match_the_in_step_engine(tiny_models, trial):
    """Random pools, budgets, caps and requests (greedy or seeded, n>1, stop tokens,
    min_tokens, logprobs): async and in-step give the same tokens and free every block.
    Unseeded sampling is left out: the extra token async computes past a stop draws from
    the engine's shared generator, so those streams differ by design."""
    import random

    path, _ = tiny_models("llama")
    rng = random.Random(trial)
    kw = dict(num_kv_blocks=rng.choice([20, 40, 256]), max_num_batched_tokens=rng.choice([8, 16, 64, 2048]),
              max_num_seqs=rng.choice([2, 4, 64]), enable_prefix_caching=rng.random() < 0.7, seed=trial)
    ps, params = [], []
    for _ in range(rng.randint(3, 12)):
        base = [rng.randrange(1, 250) for _ in range(rng.randint(1, 6))] * rng.randint(1, 3)
        ps.append({"prompt_token_ids": base[:30]})
        t, mt = rng.choice([0.0, 0.8, 1.2]), rng.randint(1, 20)
        params.append(SamplingParams(
            temperature=t, seed=rng.randrange(100) if t else None, max_tokens=mt, n=rng.choice([1, 2]) if t else 1,
            ignore_eos=rng.random() < 0.5, logprobs=rng.choice([None, 0, 2]), min_tokens=min(mt, rng.choice([0, 2])),
            stop_token_ids=[rng.randrange(1, 250)] if rng.random() < 0.3 else None))
    sync, asyn = make(path, False, **kw), make(path, True, **kw)
    assert_same(sync.generate(ps, params), asyn.generate(ps, params))
    for llm in (sync, asyn):
        assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
