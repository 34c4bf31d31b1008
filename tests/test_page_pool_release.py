"""The page pool of the start-up memory profile is scaffolding: once the peak is measured,
nothing may keep it, or the real pool (sized from what the profile left) does not fit
beside it. One forgotten reference (the swap copies' pool list) kept a 128k-token profile
pool of Llama-3.1-8B, 8 GiB, alive on an H100 and the real pool's allocation failed."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from pagedllm import LLM


def test_release_drops_every_reference_to_the_pool(tiny_models):
    """After release_kv_cache the pool tensor (and a swap space's host pool) are freed."""
    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=16, device="cpu",
              swap_space=1e-3)
    runner = llm.engine.executor.runner
    pools = [weakref.ref(p) for p in runner._kv_pools + runner._host_pools]
    assert len(pools) == 2 and runner.kv_caches
    runner.release_kv_cache()
    gc.collect()
    assert all(ref() is None for ref in pools) and not runner.kv_caches


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_profile_pool_is_freed_on_cuda(tiny_models):
    """A long max_model_len makes the profile's pool large (one 32k-token sequence of
    128 KiB blocks: 256 MiB); after start-up the device holds the weights, the real pool and
    small buffers, not that pool as well."""
    path, _ = tiny_models("llama", hidden_size=256, num_key_value_heads=4, num_attention_heads=4, num_hidden_layers=8,
                          max_position_embeddings=32768)
    llm = LLM(model=path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16", block_size=16,
              max_model_len=32768, max_num_batched_tokens=32768, enforce_eager=True,
              gpu_memory_utilization=0.3)
    runner = llm.engine.executor.runner
    profile_pool = 2048 * runner.bytes_per_block  # 32768 tokens of pages
    pool = sum(p.numel() * p.element_size() for p in runner._kv_pools)
    rest = torch.cuda.memory_allocated() - pool - runner.weight_bytes
    assert rest < profile_pool / 2, (rest, profile_pool)
