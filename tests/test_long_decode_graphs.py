"""A decode batch with one long context among short ones (attention.long_decode) replays
DecodeGraphs' second set, whose attention splits every sequence's keys; greedy tokens
and logprobs equal the same engine's eager steps. On the CPU (Triton's interpreter) the
graphs are stood in for as in test_verify_graphs.py (a "replay" runs the captured
function again on the persistent inputs); the GPU-marked test replays real graphs. The
kernels' split of such a batch is checked against the torch reference in
test_triton_attention.py."""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_spec_decode import assert_same_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.attention import long_decode, metadata
from pagedllm.worker import cuda_graphs, model_runner

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _prompts() -> list[dict]:
    rng = random.Random(2)
    return [{"prompt_token_ids": [rng.randrange(5, 250) for _ in range(n)]} for n in (9, 17, 5, 12, 30, 400)]


def test_long_decode_rule():
    import numpy as np

    assert not long_decode(np.array([32000]))  # alone: the batch-size rule splits it
    assert not long_decode(np.array([32000, 30000]))  # two alike
    assert long_decode(np.array([300] * 64 + [32000]))
    assert not long_decode(np.array([300] * 64 + [4000]))  # under LONG_DECODE_KEYS


@pytest.mark.skipif(not INTERPRET or torch.cuda.is_available(), reason="the stand-in graphs run in Triton's "
                    "interpreter on the CPU (tests/test_flash_decoding.py runs this there)")
def test_the_split_set_replays_for_a_long_context_among_short_ones_interpreted(tiny_models, monkeypatch):
    # imported here: that module skips itself off the interpreter, and the rule test must not
    from test_verify_graphs import _replayed_capture

    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(metadata, "LONG_DECODE_KEYS", 128)
    monkeypatch.setattr(cuda_graphs, "_capture", _replayed_capture)
    path, _ = tiny_models("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)

    def engine() -> LLM:
        return LLM(model=path, skip_tokenizer_init=True, block_size=16, device="cpu", max_model_len=512,
                   max_num_seqs=8, seed=0, dtype="float32")

    want = engine().generate(_prompts(), params)
    llm = engine()
    runner = llm.engine.executor.runner
    runner.graphs = graphs = cuda_graphs.DecodeGraphs(runner.model, runner.kv_caches, runner.device, 8,
                                                      -(-runner.max_model_len // runner.block_size),
                                                      long_variants=True)
    # both sets write into one buffer (no copy of every size's logits)
    base = graphs.logits[graphs.sizes[-1]].data_ptr()
    assert all(graphs.long_logits[s].data_ptr() == graphs.logits[s].data_ptr() == base for s in graphs.sizes)
    from pagedllm.attention import triton_backend

    splits = []  # each decode launch's split count
    launch = triton_backend.TritonPagedAttention._split_launch

    def spy(*a):
        if a[12]:  # direct: a decode launch
            splits.append(a[9])
        return launch(*a)

    monkeypatch.setattr(triton_backend.TritonPagedAttention, "_split_launch", staticmethod(spy))
    got = llm.generate(_prompts(), params)
    assert_same_greedy(want, got)
    assert graphs.long_replays > 0  # the 400-token prompt's decodes beside five short ones
    assert graphs.replays == graphs.long_replays  # (replays counts either set: every decode step had it)
    # those replays split every sequence's keys over MAX_KV_SPLITS, where the batch alone
    # (8 graph rows, 2 KV heads on the interpreter's 8 "SMs") would split them in two
    assert triton_backend.MAX_KV_SPLITS in splits and triton_backend.kv_splits(8, 2, runner.device) < 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays CUDA graphs")
def test_one_long_context_among_short_ones_replays_the_split_graphs(tiny_models, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(metadata, "LONG_DECODE_KEYS", 128)
    monkeypatch.setattr(model_runner, "LONG_DECODE_KEYS", 128)
    path, _ = tiny_models("llama")
    prompts = _prompts()
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
