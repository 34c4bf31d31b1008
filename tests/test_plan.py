"""`pagedllm plan` gives the pool the engine itself builds, without loading weights, and
both say in words how many full-length sequences it holds."""

from __future__ import annotations

import re

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints import cli
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


def _pool_sentence(text: str, max_len: int) -> float:
    m = re.search(rf"the KV pool holds ([\d.]+) sequences? of {max_len} tokens \(max_model_len\)", text)
    assert m, text
    return float(m[1])


def test_plan_and_engine_say_how_many_full_length_sequences_fit(tiny_models, capsys):
    """Both state the pool in full-length sequences, with the same words and number, and
    the number is the engine's pool over max_model_len."""
    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=256, block_size=8,
              kv_cache_memory=3_000_000)
    said = llm.engine.describe()["kv_pool"]
    pool = llm.engine.kv.num_blocks * 8
    assert _pool_sentence(said, 256) == pytest.approx(pool / 256, abs=0.005)
    args = cli.build_parser().parse_args(["plan", path, "--max-model-len", "256", "--block-size",
                                          "8", "--kv-cache-memory", "3000000"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert f"float32: {said}\n" in printed  # the engine computes in float32 on CPU


def test_a_pool_shorter_than_max_model_len_says_what_is_refused(tiny_models):
    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=256, block_size=8,
              num_kv_blocks=16)
    said = llm.engine.describe()["kv_pool"]
    assert _pool_sentence(said, 256) == 0.5
    assert said.endswith("a request needing more than its 128 tokens is refused")
    with pytest.raises(ValueError, match="whole pool holds 128"):
        llm.generate({"prompt_token_ids": list(range(100))}, SamplingParams(max_tokens=100))
    llm.generate({"prompt_token_ids": list(range(100))}, SamplingParams(max_tokens=28))


def test_plan_sets_the_lora_slots_aside(tiny_models, capsys):
    """The slot memory plan reserves is what an engine with those slots allocates (every
    lora_a / lora_b buffer), and the GPU pool shrinks by it."""
    from pagedllm.worker.lora_manager import lora_slot_bytes

    path, _ = tiny_models("llama")
    llm = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=16, dtype="float32",
              enable_lora=True, max_loras=3, max_lora_rank=8)
    model = llm.engine.executor.runner.model
    allocated = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                    if n.rsplit(".", 1)[-1] in ("lora_a", "lora_b"))
    assert allocated > 0
    assert lora_slot_bytes(model, 3, 8, 4) == allocated
    info, with_lora = plan_rows(path, gpu_memory=0.05, max_loras=3, max_lora_rank=8)
    _, without = plan_rows(path, gpu_memory=0.05)
    assert "lora_slots" in info
    for a, b in zip(with_lora, without, strict=True):
        assert a.kv_blocks < b.kv_blocks
    cli.main(["plan", path, "--gpu-memory", "0.05", "--enable-lora", "--max-loras", "3",
              "--max-lora-rank", "8"])
    assert "lora_slots: 3 x rank 8" in capsys.readouterr().out
