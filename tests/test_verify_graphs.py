"""The layout of CUDA-graph verify steps (worker/cuda_graphs.py VerifyGraphs): every
sequence's last token and drafts right-aligned in k + 1 rows, padding rows in front,
the prefill kernel over fixed tiles, logits gathered back into the step's rows.

On the CPU (Triton's interpreter) the graphs are stood in for: "capture" keeps the
captured function and "replay" runs it again on the persistent input buffer, which is
exactly what a replay computes. The GPU-marked test in test_spec_decode.py replays real
graphs. Greedy tokens and logprobs equal an engine without speculation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_spec_decode import PROMPTS, SPEC, assert_same_greedy
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm import LLM, SamplingParams
from pagedllm.worker import cuda_graphs


def _replayed_capture(sizes, device, forward, before=None, pool=None, shared=None):
    """Largest first into one shared output buffer, as the real capture."""
    shared = cuda_graphs.SharedOutput() if shared is None else shared
    graphs, outputs = {}, {}
    for size in reversed(sizes):
        if before is not None:
            before(size)
        outputs[size] = shared.keep(forward(size))
        graphs[size] = SimpleNamespace(replay=lambda size=size: shared.keep(forward(size)),
                                       pool=lambda: None)
    return graphs, outputs


@pytest.mark.skipif(DEV != "cpu", reason="the GPU test in test_spec_decode.py replays real graphs")
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verify_layout_gives_the_eager_tokens(tiny_models, monkeypatch, method):
    """n-gram drafts (k = 4) and the target as its own draft model (k = 3)."""
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(cuda_graphs, "_capture", _replayed_capture)
    path, _ = tiny_models("llama")
    kw = dict(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=24, enable_prefix_caching=True, seed=0, dtype="float32")
    config = SPEC if method == "ngram" else {"model": path, "num_speculative_tokens": 3, "max_batch_size": 8}
    base = LLM(**kw)
    spec = LLM(**kw, speculative_config=config)
    runner = spec.engine.executor.runner
    s = runner.model.shape
    runner.verify_graphs = graphs = cuda_graphs.VerifyGraphs(
        runner.model, runner.kv_caches, runner.device, 8, -(-runner.max_model_len // runner.block_size),
        config["num_speculative_tokens"] + 1, runner.backend.tile_q(s.num_heads // s.num_kv_heads))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    want, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert_same_greedy(want, got)
    assert graphs.replays > 0 and spec.engine.stats().spec_num_accepted_tokens > 0
