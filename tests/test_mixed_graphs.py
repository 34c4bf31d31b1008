"""Steps that carry decodes and capped prompt chunks, replayed from CUDA graphs
(worker/cuda_graphs.py MixedGraphs): decodes in the first rows, up to four prompt chunks
packed after them, padding rows as one more sequence, the prefill kernel over a fixed
number of tiles, logits of the decode rows and each chunk's last row only.

On the CPU (Triton's interpreter) the graphs are stood in for as in test_verify_graphs.py:
"capture" keeps the captured function and "replay" runs it again on the persistent input
buffer, which is what a replay computes. The GPU-marked test replays real graphs. Greedy
tokens and logprobs equal the same engine's eager steps."""

from __future__ import annotations

import random

import pytest
from test_spec_decode import assert_same_greedy
from test_verify_graphs import _replayed_capture
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm import LLM, SamplingParams
from pagedllm.worker import cuda_graphs

# Long prompts read 32 tokens a step beside the decodes, and short ones packed together
LENGTHS = [5, 70, 9, 41, 3, 100, 17, 60, 2, 33]


def _prompts() -> list[dict]:
    rng = random.Random(4)
    return [{"prompt_token_ids": [rng.randrange(5, 250) for _ in range(n)]} for n in LENGTHS]


def _engine(path: str, device: str, **kw) -> LLM:
    return LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=512, device=device,
               max_num_batched_tokens=48, max_prefill_tokens_with_decodes=32, max_num_seqs=8,
               enable_prefix_caching=True, seed=0, dtype="float32", **kw)


@pytest.mark.skipif(DEV != "cpu", reason="the GPU test below replays real graphs")
@pytest.mark.parametrize("asyn", [False, True])
def test_mixed_layout_gives_the_eager_tokens(tiny_models, monkeypatch, asyn):
    """With async scheduling the decodes' input tokens are still on the device when the
    step is laid out (filled in before the replay). The replayed steps split their keys
    (splits of 16 keys here, so the short contexts split; up to 4 splits a tile) where the
    eager reference does not split at all."""
    from pagedllm.attention import triton_backend

    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(triton_backend, "SPLIT_MIN_KEYS", 16)
    monkeypatch.setattr(cuda_graphs, "_capture", _replayed_capture)
    path, _ = tiny_models("llama")
    base = _engine(path, "cpu")
    mixed = _engine(path, "cpu", async_scheduling=asyn)
    runner = mixed.engine.executor.runner
    s = runner.model.shape
    runner.mixed_graphs = graphs = cuda_graphs.MixedGraphs(
        runner.model, runner.kv_caches, runner.device, 8, -(-runner.max_model_len // runner.block_size),
        [16, 32], runner.backend.tile_q(s.num_heads // s.num_kv_heads))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    monkeypatch.setattr(triton_backend, "MAX_KV_SPLITS", 1)
    want = base.generate(_prompts(), params)
    monkeypatch.setattr(triton_backend, "MAX_KV_SPLITS", 4)
    got = mixed.generate(_prompts(), params)
    assert_same_greedy(want, got)
    assert graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="replays real CUDA graphs")
def test_mixed_graphs_on_cuda_give_the_eager_tokens(tiny_models, monkeypatch):
    path, _ = tiny_models("llama")
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    want = _engine(path, "cuda", enforce_eager=True).generate(_prompts(), params)
    monkeypatch.delenv("PAGEDLLM_MIXED_GRAPHS", raising=False)  # on by default
    llm = _engine(path, "cuda")
    graphs = llm.engine.executor.runner.mixed_graphs
    assert graphs is not None and graphs.chunks == [16, 32]
    got = llm.generate(_prompts(), params)
    assert_same_greedy(want, got)
    assert graphs.replays > 0
