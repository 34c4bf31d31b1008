"""Requests sharing a prompt prefix share KV pages, and outputs do not change because of it."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts(seed: int, n: int, prefix_len: int = 210):
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    return [{"prompt_token_ids": prefix + [rng.randrange(256) for _ in range(rng.randint(3, 20))]}
            for _ in range(n)]


def test_shared_prefix_is_reused_and_allocates_fewer_blocks(tiny_models):
    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=16, num_kv_blocks=128)
    kv = llm.engine.kv
    first, second = _prompts(0, 2)
    free0 = kv.num_free_blocks
    a = llm.generate([first], GREEDY)[0]
    assert a.num_cached_tokens == 0
    allocated = []
    original = kv.allocate_slots

    def spy(req, n, computed=None):
        before = len(kv.free_queue) - sum(1 for b in (computed or []) if kv.ref_cnt[b] == 0)
        ok = original(req, n, computed)
        allocated.append(before - len(kv.free_queue))
        return ok

    kv.allocate_slots = spy
    b = llm.generate([second], GREEDY)[0]
    assert b.num_cached_tokens == 208  # 13 full blocks of the 210-token shared prefix
    new_blocks = sum(allocated)
    assert new_blocks < -(-len(second["prompt_token_ids"]) // 16)
    assert kv.num_free_blocks == free0
    assert kv.prefix_hits >= 208


@pytest.mark.parametrize("pool", [128, 40])
def test_outputs_identical_with_and_without_caching(tiny_models, pool):
    """pool=40 blocks of 16 forces eviction of cached blocks and preemption."""
    path, _ = tiny_models("qwen2")
    prompts = _prompts(1, 6)
    results = []
    for caching in (True, False):
        llm = LLM(model=path, skip_tokenizer_init=True, block_size=16, num_kv_blocks=pool,
                  enable_prefix_caching=caching)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        outs += llm.generate(prompts[::-1], GREEDY)  # again: served from the cache when on
        results.append([o.outputs[0].token_ids for o in outs])
        if caching:
            assert any(o.num_cached_tokens > 0 for o in outs)
            if pool == 40:
                assert llm.engine.scheduler.num_preemptions_total > 0
        else:
            assert all(o.num_cached_tokens == 0 for o in outs)
    assert results[0] == results[1]


def test_reset_prefix_cache(tiny_models):
    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=16, num_kv_blocks=64)
    p = _prompts(2, 1)
    llm.generate(p, GREEDY)
    assert llm.generate(p, GREEDY)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.generate(p, GREEDY)[0].num_cached_tokens == 0
