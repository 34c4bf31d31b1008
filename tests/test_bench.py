"""`pagedllm bench throughput`: the workloads match the benchmark notes, the dataset is the same
for every backend, the counts are exact, and the JSON carries what a result needs."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.entrypoints.bench import add_bench_parser, build_parser, main
from pagedllm.entrypoints.bench_roofline import H200_BANDWIDTH_TBPS, H200_MATMUL_TFLOPS, roofline
from pagedllm.entrypoints.bench_throughput import resolve_config
from pagedllm.entrypoints.bench_workloads import (
    LLAMA2_7B_CONFIG,
    QWEN3_0_6B_CONFIG,
    WORKLOADS,
    length_range,
    random_dataset,
    write_arch_config,
)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
}


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["throughput", *argv])


def test_presets_are_the_benchmarks_md_workloads():
    w = WORKLOADS["gpu-7b"]
    assert (w.num_prompts, w.input_range, w.output_range, w.dtype, w.load_format) == (
        256, (256, 256), (256, 256), "bfloat16", "dummy")
    c = w.arch_config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"]) == (
        4096, 32, 32, 32, 11008, 32000)
    w = WORKLOADS["gpu-0.6b"]
    assert (w.num_prompts, w.input_range, w.output_range) == (256, (100, 1024), (100, 1024))
    c = w.arch_config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["head_dim"], c["intermediate_size"], c["vocab_size"],
            c["tie_word_embeddings"]) == (1024, 28, 16, 8, 128, 3072, 151936, True)
    w = WORKLOADS["cpu-smol"]
    assert (w.arch_config, w.num_prompts, w.input_range, w.output_range, w.hf_batch_size) == (
        None, 16, (32, 256), (128, 128), 16)


def test_preset_fills_only_unset_flags():
    cfg = resolve_config(_parse("--workload", "cpu-smol"))
    assert (cfg.num_prompts, cfg.input_range, cfg.output_range, cfg.dtype) == (
        16, (32, 256), (128, 128), "float32")
    cfg = resolve_config(_parse("--workload", "cpu-smol", "--num-prompts", "4",
                                "--output-len", "8"))
    assert (cfg.num_prompts, cfg.input_range, cfg.output_range) == (4, (32, 256), (8, 8))
    cfg = resolve_config(_parse("--workload", "gpu-7b", "--hf-static-cache"))
    assert cfg.hf_batch_size == 256 and cfg.load_format == "dummy"
    with open(f"{cfg.model}/config.json") as f:
        assert json.load(f)["hidden_size"] == 4096


def test_length_range_is_vllms_random_dataset_rule():
    assert length_range(256, 0.0) == (256, 256)
    assert length_range(256, 0.5) == (128, 384)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_random_dataset_is_reproducible_and_in_range():
    a = random_dataset(50, (3, 9), (2, 5), vocab_size=100, seed=0)
    b = random_dataset(50, (3, 9), (2, 5), vocab_size=100, seed=0)
    assert a == b
    assert a != random_dataset(50, (3, 9), (2, 5), vocab_size=100, seed=1)
    assert all(3 <= len(p) <= 9 and all(0 <= t < 100 for t in p) for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens)
    assert {len(p) for p in a.prompts} == set(range(3, 10))  # both ends are reachable


def test_roofline_matches_the_benchmark_notes():
    """The project's benchmark notes: about 13,000 tok/s for gpu-7b and 40,000 for gpu-0.6b on an H200."""
    from transformers import AutoConfig

    def roof(arch: dict, workload: str) -> float:
        cfg = AutoConfig.for_model(arch["model_type"], **{k: v for k, v in arch.items()
                                                          if k != "model_type"})
        w = WORKLOADS[workload]
        data = random_dataset(w.num_prompts, w.input_range, w.output_range, 1000, 0)
        return roofline(cfg, 2, [len(p) for p in data.prompts], data.output_lens, 256,
                        H200_BANDWIDTH_TBPS, H200_MATMUL_TFLOPS)["output_tokens_per_s"]

    assert 12_000 < roof(LLAMA2_7B_CONFIG, "gpu-7b") < 14_000
    assert 33_000 < roof(QWEN3_0_6B_CONFIG, "gpu-0.6b") < 45_000


def test_add_bench_parser_wires_into_a_cli():
    parser = argparse.ArgumentParser(prog="pagedllm")
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "throughput", "--backend", "both", "--hf-batch-size", "4"])
    assert args.func is main and args.bench_command == "throughput"
    assert (args.backend, args.hf_batch_size, args.seed) == ("both", 4, 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench"])  # a kind is required


@pytest.mark.parametrize("tp", [1, 2])
def test_throughput_on_dummy_weights_writes_exact_counts(tmp_path, tp):
    model = write_arch_config(TINY_LLAMA, str(tmp_path))
    out = tmp_path / "result.json"
    args = _parse("--model", model, "--load-format", "dummy", "--num-prompts", "5",
                  "--input-len", "12", "--output-len", "7", "--warmup", "2",
                  "--num-kv-blocks", "64", "--device", "cpu", "--output-json", str(out),
                  "--tensor-parallel-size", str(tp))
    assert main(args) == 0
    result = json.loads(out.read_text())
    r = result["results"]["pagedllm"]
    assert r["num_requests"] == 5 and r["output_tokens"] == 5 * 7 and r["prompt_tokens"] == 5 * 12
    assert r["output_tokens_per_s"] == pytest.approx(35 / r["elapsed_s"], rel=1e-2)
    assert r["total_tokens_per_s"] == pytest.approx(95 / r["elapsed_s"], rel=1e-2)
    env = result["environment"]
    for key in ("date", "device", "device_name", "torch", "transformers", "git"):
        assert key in env
    assert "commit" in env["git"]
    assert result["args"]["num_prompts"] == 5 and result["workload"]["load_format"] == "dummy"
    assert result["args"]["tensor_parallel_size"] == tp
    assert result["engine"]["kv_blocks"] == 64 and "hf" not in result["results"]


def test_both_backends_run_the_same_workload(tiny_models, tmp_path):
    path, _ = tiny_models("llama")
    out = tmp_path / "both.json"
    args = _parse("--model", path, "--backend", "both", "--num-prompts", "6", "--repeats", "2",
                  "--input-len", "10", "--output-len", "6", "--range-ratio", "0.5",
                  "--hf-batch-size", "4", "--temperature", "0", "--warmup", "1",
                  "--device", "cpu", "--output-json", str(out))
    result = main(args) == 0 and json.loads(out.read_text())
    ours, hf = result["results"]["pagedllm"], result["results"]["hf"]
    assert ours["output_tokens"] == hf["output_tokens"] == result["workload"]["output_tokens"]
    assert ours["prompt_tokens"] == hf["prompt_tokens"]
    assert len(ours["elapsed_s_runs"]) == len(hf["elapsed_s_runs"]) == 2
    # A static batch runs to its longest request: never fewer tokens than were asked for.
    assert hf["generated_tokens"] >= hf["output_tokens"]
    assert hf["batch_size"] == 4 and hf["static_cache"] is False and hf["dtype"] == "float32"
    assert result["ratio"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"], rel=1e-2)


def test_hf_static_cache_runs_on_cpu(tiny_models):
    path, _ = tiny_models("llama")
    args = _parse("--model", path, "--backend", "hf", "--hf-static-cache", "--num-prompts", "3",
                  "--input-len", "8", "--output-len", "4", "--range-ratio", "0.5",
                  "--hf-batch-size", "2", "--device", "cpu")
    result = args.bench_run(args)
    hf = result["results"]["hf"]
    assert hf["static_cache"] is True and hf["compiled"] is False
    assert hf["output_tokens"] == result["workload"]["output_tokens"]
