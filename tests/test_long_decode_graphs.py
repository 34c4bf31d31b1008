"""A decode batch with one long context among short ones (attention.long_decode) replays
DecodeGraphs' second set, whose attention splits every sequence's keys; greedy tokens
and logprobs equal the same engine's eager steps (real CUDA graphs: GPU only);
the kernels' split of such a batch is checked against the torch reference in
test_triton_attention.py (also in Triton's interpreter)."""

from __future__ import annotations

import random

import pytest
import torch
from test_spec_decode import assert_same_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.attention import long_decode, metadata
from pagedllm.worker import model_runner


def test_long_decode_rule():
    import numpy as np

    assert not long_decode(np.array([32000]))  # alone: the batch-size rule splits it
    assert not long_decode(np.array([32000, 30000]))  # two alike
    assert long_decode(np.array([300] * 64 + [32000]))
    assert not long_decode(np.array([300] * 64 + [4000]))  # under LONG_DECODE_KEYS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_one_long_context_among_short_ones_replays_the_split_graphs(tiny_models, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(metadata, "LONG_DECODE_KEYS", 128)
    monkeypatch.setattr(model_runner, "LONG_DECODE_KEYS", 128)
    path, _ = tiny_models("llama")
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 250) for _ in range(n)]} for n in (9, 17, 5, 12, 30, 400)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def engine(**kw) -> LLM:
        return LLM(model=path, skip_tokenizer_init=True, block_size=16, device="cuda", max_model_len=512,
                   max_num_seqs=8, seed=0, dtype="float32", **kw)

    want = engine(enforce_eager=True).generate(prompts, params)
    llm = engine()
    graphs = llm.engine.executor.runner.graphs
    assert graphs is not None and graphs.long_graphs
    got = llm.generate(prompts, params)
    assert_same_greedy(want, got)
    assert graphs.long_replays > 0
