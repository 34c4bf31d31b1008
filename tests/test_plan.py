"""`pagedllm plan` gives the pool the engine itself builds, without loading weights."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.entrypoints.plan import count_parameters, plan_rows


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plan_matches_engine_pool_and_parameters(tiny_models, arch):
    path, hf = tiny_models(arch)
    info, rows = plan_rows(path, max_model_len=256, block_size=8, kv_cache_memory=3_000_000)
    f32 = rows[0]
    llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=256, block_size=8,
              kv_cache_memory=3_000_000)
    assert f32.format == "float32"
    assert f32.kv_blocks == llm.engine.kv.num_blocks
    assert f32.weights_bytes == llm.engine.executor.weight_bytes
    assert info["parameters"] == sum(p.numel() for p in hf.parameters())
    linear, other = count_parameters(hf.config)
    assert linear + other == info["parameters"]
    # Lower precision: smaller weights, more KV tokens.
    assert rows[1].weights_bytes < f32.weights_bytes and rows[1].kv_tokens > f32.kv_tokens
    assert rows[-1].weights_bytes < rows[1].weights_bytes


def test_plan_default_cpu_pool_matches_engine(tiny_models):
    path, _ = tiny_models("llama")
    _, rows = plan_rows(path, max_model_len=128, max_num_seqs=4)
    llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4)
    assert rows[0].kv_blocks == llm.engine.kv.num_blocks
    assert rows[0].seqs_at_max_len == pytest.approx(4.0)


def test_plan_gpu_memory_shrinks_with_utilization(tiny_models):
    path, _ = tiny_models("llama")
    _, hi = plan_rows(path, gpu_memory=1.0, gpu_memory_utilization=0.9)
    _, lo = plan_rows(path, gpu_memory=1.0, gpu_memory_utilization=0.5)
    assert hi[1].kv_blocks > lo[1].kv_blocks > 0
