"""Greedy tokens and logprobs equal Hugging Face transformers on tiny random models,
for a batch of mixed-length prompts generated together, also under preemption and
chunked prefill."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch
from hf_models import hf_greedy

from pagedllm import LLM, SamplingParams

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_NEW = 10


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _check(llm: LLM, hf_model, prompts, max_new=MAX_NEW):
    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, o in zip(prompts, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf_model, p, max_new)
        got = o.outputs[0]
        assert got.token_ids == ref_tokens
        assert got.finish_reason == "length"
        lps = [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert lps == pytest.approx(ref_lps, abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(sum(ref_lps), abs=1e-3)
        for pos, t in zip(got.logprobs, got.token_ids, strict=True):
            assert pos[t].rank == 1  # greedy picks the top token
            assert len(pos) <= 3


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_parity(tiny_models, arch):
    path, hf = tiny_models(arch)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    _check(llm, hf, _prompts(6, seed=1))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_parity_under_preemption(tiny_models, arch):
    path, hf = tiny_models(arch)
    # 28-token prompts take 7 blocks of 4 and grow to 10: two fit the 16-block pool
    # when admitted, but not once both have grown, so the newer one is preempted.
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=16,
              enable_prefix_caching=False)
    prompts = _prompts(6, seed=2, lo=28, hi=28)
    _check(llm, hf, prompts, max_new=12)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.kv.num_free_blocks == 16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parity_with_chunked_prefill(tiny_models, arch):
    path, hf = tiny_models(arch)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=7)
    engine = llm.engine
    seen_chunked = []
    step = engine.executor.execute

    def spy(so):
        seen_chunked.extend(c.num_tokens for c in so.chunks if c.num_tokens > 1 and not c.sample)
        assert so.num_batched_tokens <= 7
        return step(so)

    engine.executor.execute = spy
    _check(llm, hf, _prompts(4, seed=3, lo=15, hi=40))
    assert seen_chunked, "a 7-token budget must split the prompts"


def test_parity_prefix_cache_hits(tiny_models):
    path, hf = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    shared = _prompts(1, seed=4, lo=20, hi=20)[0]
    prompts = [shared + tail for tail in _prompts(3, seed=5, lo=2, hi=9)]
    _check(llm, hf, prompts[:1])
    _check(llm, hf, prompts[1:])
    again = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=2))
    assert again[0].num_cached_tokens >= 20


def test_parity_pt_bin_and_llama3_rope(tiny_models):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    path, hf = tiny_models("llama", rope_scaling=rope, max_position_embeddings=512, safetensors=False)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=8, num_kv_blocks=128)
    _check(llm, hf, _prompts(3, seed=6, lo=60, hi=90))


def test_parity_tied_embeddings_and_attention_bias(tiny_models):
    path, hf = tiny_models("llama", tie_word_embeddings=True, attention_bias=True)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    _check(llm, hf, _prompts(3, seed=7))


def _check_prompt_logprobs(out, hf, prompt: list[int]) -> None:
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = int(ref[i - 1].argmax())
        assert top in entry


def test_prompt_logprobs_match_hf(tiny_models):
    path, hf = tiny_models("qwen2")
    prompt = _prompts(1, seed=8, lo=25, hi=25)[0]
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64,
              max_num_batched_tokens=9)  # chunked: prompt logprobs arrive in pieces
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    _check_prompt_logprobs(out, hf, prompt)


def test_prompt_logprobs_are_whole_with_the_prefix_cache_warm(tiny_models):
    """What scoring clients (echo + logprobs) rely on: a prompt whose blocks are cached,
    whole or as a shared prefix, still gets every position's logprob, equal to HF's."""
    path, hf = tiny_models("qwen2")
    shared = _prompts(1, seed=9, lo=32, hi=32)[0]
    other = shared[:20] + _prompts(1, seed=10, lo=12, hi=12)[0]
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": shared}], SamplingParams(temperature=0, max_tokens=1))
    hits = llm.engine.kv.prefix_hits
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    for prompt in (shared, other, shared):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        _check_prompt_logprobs(out, hf, prompt)
    assert llm.engine.kv.prefix_hits == hits  # the cached blocks were there, and not taken
    llm.generate([{"prompt_token_ids": shared}], SamplingParams(temperature=0, max_tokens=1))
    assert llm.engine.kv.prefix_hits > hits  # other requests still take them


@contextmanager
def _rows_seen(llm: LLM):
    """Rows into the first layer's MLP and the last layer's MLP and output projection, per
    call, while the block runs."""
    layers = llm.engine.executor.runner.model.model.layers
    rows: dict[str, list[int]] = {"first": [], "last": [], "last_o": []}
    watched = {"first": layers[0].mlp, "last": layers[-1].mlp, "last_o": layers[-1].self_attn.o_proj}
    hooks = [m.register_forward_pre_hook(lambda _m, a, key=key: rows[key].append(a[0].shape[0]))
             for key, m in watched.items()]
    try:
        yield rows
    finally:
        for h in hooks:
            h.remove()


def test_last_layer_mlp_runs_only_sampled_rows(tiny_models):
    """A step's last layer sends only the rows it samples through its attention's output
    projection and its MLP (a prompt's last token), every other layer all rows; tokens and
    logprobs stay HF's. A request with prompt logprobs reads every row's output: nothing
    is skipped for it."""
    path, hf = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    prompts = _prompts(3, seed=7, lo=20, hi=30)
    with _rows_seen(llm) as rows:
        _check(llm, hf, prompts, max_new=4)
    # the first step reads the three prompts whole and samples one row of each
    assert rows["first"][0] == sum(len(p) for p in prompts)
    assert rows["last"][0] == rows["last_o"][0] == 3
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with _rows_seen(llm) as rows:
        out = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert rows["last"][0] == rows["first"][0] == len(prompts[0])
    assert len(out.prompt_logprobs) == len(prompts[0])


def test_chunks_that_sample_nothing_skip_the_last_layer(tiny_models):
    """A prompt read in chunks: the chunks before its last sample nothing, so their last
    layer only writes keys and values (no attention output, no MLP); the tokens and
    logprobs that follow still equal HF's, so those keys and values were written."""
    path, hf = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=16)
    with _rows_seen(llm) as rows:
        _check(llm, hf, _prompts(1, seed=11, lo=40, hi=40), max_new=3)
    assert rows["first"] == [16, 16, 8, 1, 1]  # three chunks, then two decodes
    assert rows["last"] == rows["last_o"] == [1, 1, 1]  # the last chunk's final row, the decodes
