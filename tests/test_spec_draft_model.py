"""Draft-model speculative decoding: a second checkpoint proposes, the target verifies.

References: the target alone (greedy tokens equal, whatever the draft proposes), and the
target as its own draft (every greedy draft accepted, up to near-tied logits)."""

from __future__ import annotations

import pytest
from test_spec_decode import PROMPTS, assert_same_greedy, tokens

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig


def make(path: str, draft: str | None, k: int = 3, **kw) -> LLM:
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": k, "max_batch_size": 8}
    return LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
               max_num_batched_tokens=24, enable_prefix_caching=True, seed=0,
               speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def models(tiny_models):
    target, _ = tiny_models("llama")
    draft, _ = tiny_models("llama", num_hidden_layers=1, seed=7)
    return target, draft


@pytest.fixture(scope="module")
def base(models):
    return make(models[0], None)


def test_own_draft_accepts_nearly_everything(models, base):
    target, _ = models
    spec = make(target, target, k=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
    want, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert_same_greedy(want, got)
    s = spec.engine.stats()
    assert s.spec_num_draft_tokens >= 40
    assert s.spec_num_accepted_tokens >= 0.9 * s.spec_num_draft_tokens
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks


def test_a_different_draft_keeps_the_targets_greedy_tokens(models, base):
    """Most drafts of an unrelated model are rejected: the rolled-back positions must be
    rewritten in the draft's pages before they are read, across chunked prompts, the
    prefix cache (run twice) and n > 1."""
    spec = make(*models)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, n=2)
    for _ in range(2):
        assert tokens(spec.generate(PROMPTS, params)) == tokens(base.generate(PROMPTS, params))
    s = spec.engine.stats()
    assert s.spec_num_draft_tokens > 0
    assert s.spec_num_accepted_tokens < s.spec_num_draft_tokens  # it really disagreed somewhere


def test_stops_and_seeded_sampling_with_a_draft_model(models, base):
    target, draft = models
    spec = make(target, draft, k=2)
    free = base.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    toks = free[0].outputs[0].token_ids
    p = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[toks[7]])
    assert tokens(spec.generate(PROMPTS[:1], p)) == tokens(base.generate(PROMPTS[:1], p))
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=15, ignore_eos=True) for s in range(3)]
    a, b = spec.generate(PROMPTS[:3], seeded), spec.generate(PROMPTS[:3], seeded)
    assert tokens(a) == tokens(b)


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, models):
    other, _ = tiny_models("llama", vocab_size=320)
    with pytest.raises(ValueError, match="speculative_config.model"):
        make(models[0], other)


def test_draft_model_with_tensor_parallelism_is_refused(models):
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model=models[0], tensor_parallel_size=2, speculative_config={"model": models[1]})


def test_the_draft_pages_are_counted(models):
    target, draft = models
    a, b = make(target, None), make(target, draft)
    r0, r1 = a.engine.executor.runner, b.engine.executor.runner
    assert r1.bytes_per_block == r0.bytes_per_block + r1.drafter.bytes_per_block
    assert r1.drafter.bytes_per_block * 2 == r0.bytes_per_block  # one layer of two


def test_seeded_samples_are_the_same_with_and_without_speculation(models, base):
    """A seeded request's t-th token uses its t-th draw, whichever steps verify drafts
    and however many of them are rejected (rejected rows' draws are rewound)."""
    for draft in models:  # its own draft (long accepted runs) and an unrelated one
        spec = make(models[0], draft, k=3)
        params = [SamplingParams(temperature=0.4, top_p=0.95, seed=s, max_tokens=20, ignore_eos=True)
                  for s in range(4)]
        assert tokens(spec.generate(PROMPTS[:4], params)) == tokens(base.generate(PROMPTS[:4], params))
        s = spec.engine.stats()
        assert s.spec_num_draft_tokens > s.spec_num_accepted_tokens  # rejections were rewound
        assert s.spec_num_accepted_tokens > 0 or draft != models[0]
