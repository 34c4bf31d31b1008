"""`pagedllm bench throughput`: the workloads match the benchmark notes, the dataset is the same
for every backend, the counts are exact, and the JSON carries what a result needs."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time

import pytest
import torch

from pagedllm.entrypoints.bench import add_bench_parser, build_parser, main
from pagedllm.entrypoints.bench_roofline import (
    H200,
    ceilings,
    known_card,
    measure_ceilings,
    roofline,
)
from pagedllm.entrypoints.bench_throughput import resolve_config
from pagedllm.entrypoints.bench_workloads import (
    LLAMA2_7B_CONFIG,
    QWEN3_0_6B_CONFIG,
    QWEN3_30B_A3B_CONFIG,
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


def test_fp8_and_long_context_presets():
    """The TensorRT-LLM rows as published (Llama-3.1-8B, FP8 weights and KV, 3,000 requests
    of fixed lengths), the KV-bound row, and the long-context rows; flags override."""
    for name, lens in (("trt-8b-1k", ((1000, 1000), (1000, 1000))),
                       ("trt-8b-2k", ((128, 128), (2048, 2048)))):
        w = WORKLOADS[name]
        assert (w.num_prompts, (w.input_range, w.output_range), w.quantization, w.kv_cache_dtype) == (
            3000, lens, "fp8", "fp8")
        c = w.arch_config
        assert (c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"], c["intermediate_size"],
                c["vocab_size"], c["rope_scaling"]["rope_type"]) == (4096, 32, 8, 14336, 128256, "llama3")
    w = WORKLOADS["gpu-7b-kv"]
    assert (w.num_prompts, w.input_range, w.output_range, w.kv_cache_dtype) == (
        512, (2048, 2048), (512, 512), "auto")
    assert (WORKLOADS["gpu-long"].num_prompts, WORKLOADS["gpu-long"].input_range) == (16, (32000, 32000))
    assert WORKLOADS["gpu-long-ttft"].output_range == WORKLOADS["gpu-long-128k"].output_range == (1, 1)
    cfg = resolve_config(_parse("--workload", "trt-8b-1k"))
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("fp8", "fp8")
    cfg = resolve_config(_parse("--workload", "gpu-7b", "--quantization", "fp8", "--kv-cache-dtype", "fp8"))
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("fp8", "fp8")
    assert resolve_config(_parse("--workload", "gpu-7b")).quantization is None


def test_fp8_roofline_halves_what_fp8_halves():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", **{k: v for k, v in LLAMA2_7B_CONFIG.items() if k != "model_type"})
    args = ([256] * 8, [256] * 8, 8, H200.bandwidth_tbps, H200.matmul_tflops)
    bf16 = roofline(cfg, 2, *args)
    w8 = roofline(cfg, 2, *args, weight_bytes=1)
    kv8 = roofline(cfg, 2, *args, weight_bytes=1, kv_bytes=1)
    head = 32000 * 4096 * 2 * 256 / (H200.bandwidth_tbps * 1e12)  # the LM head stays bf16
    assert w8["weights_read_s"] == pytest.approx((bf16["weights_read_s"] - head) / 2 + head, rel=5e-3)
    assert w8["kv_read_s"] == bf16["kv_read_s"] and kv8["kv_read_s"] == pytest.approx(bf16["kv_read_s"] / 2, rel=5e-3)
    assert w8["prefill_s"] < bf16["prefill_s"]


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
                        H200.bandwidth_tbps, H200.matmul_tflops)["output_tokens_per_s"]

    assert 12_000 < roof(LLAMA2_7B_CONFIG, "gpu-7b") < 14_000
    assert 33_000 < roof(QWEN3_0_6B_CONFIG, "gpu-0.6b") < 45_000
    # MoE counts the experts a step reads: all 128 at 256 sequences (61 GB a step), 8 for
    # one sequence (the bound for batch-1 decode: about 670 tok/s on an H200).
    assert 12_000 < roof(QWEN3_30B_A3B_CONFIG, "gpu-moe") < 16_000
    cfg = AutoConfig.for_model("qwen3_moe", **{k: v for k, v in QWEN3_30B_A3B_CONFIG.items()
                                                if k != "model_type"})
    one = roofline(cfg, 2, [128], [64], 1, H200.bandwidth_tbps, H200.matmul_tflops)
    assert 600 < one["output_tokens_per_s"] < 750


def test_ceilings_are_the_cards_own():
    """The roofline uses what this card measured; flags override; the reference of a known
    card is recorded beside, and a CPU has no roofline unless both flags are given."""
    assert known_card("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert known_card("NVIDIA H200").name == "H200"
    assert known_card("NVIDIA H100 PCIe") is None and known_card("Intel Xeon") is None
    cuda = torch.device("cuda")

    def fake(device):
        return {"bandwidth_TBps": 2.9, "matmul_TFLOPs": 770.0}

    c = ceilings(cuda, "NVIDIA H100 80GB HBM3", None, None, measure=fake)
    assert (c["bandwidth_TBps"], c["matmul_TFLOPs"]) == (2.9, 770.0)
    assert c["source"] == {"bandwidth": "measured", "matmul": "measured"}
    assert c["reference"]["name"] == "H100 SXM" and c["device_name"] == "NVIDIA H100 80GB HBM3"
    c = ceilings(cuda, "NVIDIA H200", 4.0, None, measure=fake)
    assert (c["bandwidth_TBps"], c["matmul_TFLOPs"], c["source"]["bandwidth"]) == (4.0, 770.0, "flag")
    cpu = torch.device("cpu")
    assert ceilings(cpu, "Xeon", None, None, measure=fake) is None
    assert ceilings(cpu, "Xeon", 0.1, None, measure=fake) is None
    c = ceilings(cpu, "Xeon", 0.1, 2.0, measure=fake)
    assert c["measured"] is None and c["reference"] is None and c["bandwidth_TBps"] == 0.1


def test_measure_ceilings_counts_bytes_and_flops():
    """Small sizes on CPU: the same code path as the card's, positive finite figures."""
    m = measure_ceilings(torch.device("cpu"), copy_bytes=1 << 20, matmul_n=64, repeats=2)
    assert m["bandwidth_TBps"] > 0 and m["matmul_TFLOPs"] > 0
    assert m["copy_bytes"] == 1 << 20 and m["matmul_shape"] == [64, 64, 64]


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
                  "--tensor-parallel-size", str(tp), "--peak-bandwidth", "0.05",
                  "--peak-tflops", "1")
    assert main(args) == 0
    result = json.loads(out.read_text())
    # On CPU the flags alone make a roofline: their values, and the device it was for.
    c, roof = result["ceilings"], result["roofline"]
    assert c["source"] == {"bandwidth": "flag", "matmul": "flag"} and c["measured"] is None
    assert (roof["bandwidth_TBps"], roof["matmul_TFLOPs"]) == (0.05, 1.0)
    assert roof["device_name"] == c["device_name"] == result["environment"]["device_name"]
    assert 0 < roof["achieved_fraction"]
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


# ---------------------------------------------------------------------- bench serve
class _FakeServer(http.server.BaseHTTPRequestHandler):
    """Streams `max_tokens` one-character completions, 2 ms apart with every eighth gap
    30 ms: a known ITL shape, without loading a model. A prompt of over 100 tokens waits
    0.3 s before its first token (a long prefill); every prompt's length is recorded."""

    prompt_lens: list[int] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {"version": "0"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        n = body["max_tokens"]
        _FakeServer.prompt_lens.append(len(body["prompt"]))
        if len(body["prompt"]) > 100:
            time.sleep(0.3)
        for i in range(n):
            time.sleep(0.03 if i % 8 == 7 else 0.002)
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def fake_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _offline_result(path, device: str = "NVIDIA H100 80GB HBM3") -> str:
    """An offline `bench throughput` result as run_throughput writes it (the keys read)."""
    path.write_text(json.dumps({
        "benchmark": "throughput",
        "environment": {"device_name": device, "date": "2026-12-05T00:00:00+00:00",
                        "git": {"commit": "a" * 40, "short": "aaaaaaa", "dirty": False}},
        "workload": {"name": "gpu-7b", "num_prompts": 256, "input_len_range": [12, 12],
                     "output_len_range": [16, 16]},
        "results": {"pagedllm": {"output_tokens_per_s": 1000.0}},
    }))
    return str(path)


def test_bench_serve_sets_the_offline_figure_beside_its_own(fake_server, tmp_path):
    """One serve result holds the offline tok/s, served / offline, the offline run's card,
    and the ITL's p99 / median."""
    offline = _offline_result(tmp_path / "offline.json")
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "serve", "--base-url", fake_server, "--num-prompts", "4", "--input-len", "12",
        "--output-len", "16", "--max-concurrency", "2", "--warmup", "1", "--prompt-vocab-size",
        "100", "--offline-json", offline, "--output-json", str(out)])
    assert main(args) == 0
    saved = json.loads(out.read_text())
    r = saved["results"]
    assert (r["completed"], r["total_output_tokens"]) == (4, 64), saved["errors"]
    assert r["offline_output_throughput"] == 1000.0
    assert r["offline_ratio"] == pytest.approx(r["output_throughput"] / 1000.0, rel=5e-3)
    assert r["server_device"] == "NVIDIA H100 80GB HBM3"
    assert r["itl_p99_over_median"] == pytest.approx(r["p99_itl_ms"] / r["median_itl_ms"],
                                                     rel=1e-2)
    assert r["itl_p99_over_median"] > 2  # the 30 ms gaps against the 2 ms ones
    assert saved["offline"]["path"] == offline and saved["offline"]["commit"] == "aaaaaaa"
    assert saved["offline"]["workload"]["output_len_range"] == [16, 16]


def test_bench_serve_spreads_its_clients_over_processes(fake_server, tmp_path):
    """With several client processes every request is still sent once and counted once."""
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "serve", "--base-url", fake_server, "--num-prompts", "6", "--input-len", "5",
        "--output-len", "16", "--max-concurrency", "6", "--warmup", "0", "--prompt-vocab-size",
        "100", "--client-processes", "3", "--output-json", str(out)])
    assert main(args) == 0
    r = json.loads(out.read_text())["results"]
    assert r["client_processes"] == 3
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (6, 0, 96)
    assert r["total_input_tokens"] == 30
    # The duration spans the requests (a wall-clock bound on it would measure the
    # machine's load: the three processes start in it).
    assert r["duration_s"] >= r["mean_e2el_ms"] / 1000


def test_bench_serve_mixed_workload_times_a_long_prompt_beside_the_streams(fake_server, tmp_path):
    """--long-prompt-len: one more request, sent once at its delay and not counted among
    the streams; its TTFT (the fake server's 0.3 s prefill) and the streams' gaps during
    that prefill are reported."""
    _FakeServer.prompt_lens.clear()
    out = tmp_path / "serve.json"
    args = build_parser().parse_args([
        "serve", "--base-url", fake_server, "--num-prompts", "4", "--input-len", "12",
        "--output-len", "160", "--max-concurrency", "4", "--warmup", "0", "--prompt-vocab-size",
        "100", "--long-prompt-len", "200", "--long-prompt-delay", "0.1", "--long-output-len", "3",
        "--output-json", str(out)])
    assert main(args) == 0
    r = json.loads(out.read_text())["results"]
    assert sorted(_FakeServer.prompt_lens) == [12, 12, 12, 12, 200]
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (4, 0, 48, 640)
    lp = r["long_prompt"]
    assert lp["ok"] and lp["prompt_tokens"] == 200
    assert lp["ttft_ms"] >= 300 and lp["sent_at_s"] >= 0.09
    # The streams run ~0.9 s each: they were streaming through the whole window.
    assert lp["gaps_during_prefill"] >= 10
    assert 0 < lp["median_itl_during_prefill_ms"] <= lp["p99_itl_during_prefill_ms"] <= lp["max_itl_during_prefill_ms"]
    # Every stream gap falls in one phase: before the long prompt, during its prefill, after.
    before, after = lp["before_long_prompt"], lp["after_long_prompt"]
    assert before["gaps"] > 0 and after["gaps"] > 0
    assert before["gaps"] + lp["gaps_during_prefill"] + after["gaps"] == 4 * 159
    assert before["median_itl_ms"] <= before["max_itl_ms"]


def test_bench_serve_rejects_a_file_that_is_not_an_offline_result(tmp_path):
    """Checked before the run: no server is needed to find out."""
    bad = tmp_path / "serve.json"
    bad.write_text(json.dumps({"benchmark": "serve", "results": {"output_throughput": 1.0}}))
    args = build_parser().parse_args(["serve", "--base-url", "http://127.0.0.1:9",
                                      "--offline-json", str(bad)])
    with pytest.raises(SystemExit, match="not a `bench throughput` result"):
        main(args)
