"""The engine core as its own part: plain requests in, per-step deltas out; the front end
owns text, stop strings and n; under the server the core is a process of its own, and a
core that dies makes the server answer 503 and exit non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import msgspec
import pytest
from server_process import descendants, launch_server

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    """A tiny random llama over SmolLM2's vocabulary, with its tokenizer."""
    from hf_models import save_tiny_model

    from pagedllm.config import default_model_path
    from pagedllm.tokenizers import gguf_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-smol"))
    tok = gguf_tokenizer(default_model_path())
    save_tiny_model(path, "llama", vocab_size=len(tok), max_position_embeddings=512)
    tok.save_pretrained(path)
    return path


def core_request(rid: str, ids: list[int], **kw) -> EngineCoreRequest:
    return EngineCoreRequest(rid, ids, SamplingParams(temperature=0, **kw), [], time.monotonic())


def test_the_core_sends_each_token_once_and_a_finish_reason(tiny_path):
    """Every step carries only what is new: the concatenated deltas equal the offline
    result, no sequence gets a token twice, and the last delta says why it ended."""
    want = LLM(tiny_path, num_kv_blocks=64, max_model_len=128).generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=9,
                                                        ignore_eos=True))[0].outputs[0].token_ids
    core = EngineCore(EngineConfig(model=tiny_path, num_kv_blocks=64, max_model_len=128))
    core.add_request(core_request("a", [5, 6, 7], max_tokens=9, ignore_eos=True))
    core.add_request(core_request("b", [8, 9], max_tokens=4, ignore_eos=True))
    got: dict[str, list[int]] = {"a": [], "b": []}
    finish: dict[str, str] = {}
    steps = 0
    while core.has_unfinished_requests():
        outs = core.step()
        steps += 1
        for o in outs:
            assert len(o.new_token_ids) == 1 and o.request_id not in finish
            got[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finish[o.request_id] = o.finish_reason
        # Plain data: the same bytes whether it stays in-process or crosses to a server.
        wire = msgspec.msgpack.encode(EngineCoreOutputs(outs, core.stats()))
        assert msgspec.msgpack.decode(wire, type=EngineCoreOutputs).outputs == outs
    assert got["a"] == want and len(got["b"]) == 4
    assert finish == {"a": "length", "b": "length"} and steps == 9
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_a_stop_string_ends_the_sequence_in_the_core_too(tiny_path):
    """The front end finds stop strings; the hit aborts the sequence in the core, which
    frees its blocks at once instead of generating to max_tokens."""
    llm = LLM(tiny_path, num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    full = llm.generate({"prompt_token_ids": [3, 4, 5]}, params)[0].outputs[0]
    stop = full.text[len(full.text) // 3: len(full.text) // 3 + 2]
    assert stop.strip(), full.text
    engine = llm.engine
    engine.add_request("s", None, [3, 4, 5], SamplingParams(temperature=0, max_tokens=60,
                                                            ignore_eos=True, stop=[stop]))
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
    (out,) = outs
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop and stop not in out.outputs[0].text
    assert full.text.startswith(out.outputs[0].text)
    assert steps < 60 and not engine.scheduler.requests
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_n_sequences_are_n_core_requests(tiny_path):
    llm = LLM(tiny_path, num_kv_blocks=64, max_model_len=128)
    engine = llm.engine
    engine.add_request("r", None, [1, 2, 3], SamplingParams(n=3, max_tokens=4, seed=7))
    assert sorted(engine.scheduler.requests) == ["r#0", "r#1", "r#2"]
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert [len(c.token_ids) for c in outs[0].outputs] == [4, 4, 4]


# ---------------------------------------------------------------------- the core process
@pytest.fixture()
def server(tmp_path):
    with launch_server(tmp_path, ["--max-model-len", "256", "--served-model-name", "smol"],
                       graceful_stop=False) as sp:
        yield sp


def _spawned_children(pid: int) -> list[int]:
    return [p for p in descendants(pid, depth=1)
            if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]


def test_a_core_that_cannot_start_says_why_and_exits_by_itself(tiny_path):
    """The front end reads its config while the core process starts (AsyncLLM._start_core):
    a setting the model cannot take fails there with the engine's own error, and the core,
    which resolves the same config, ends by itself (exit code 1, not killed after a hang in
    its exit) and leaves no process behind."""
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.engine.core_client import MPClient

    bad = EngineConfig(model=tiny_path, max_model_len=100_000)
    client = MPClient(bad, lambda outputs: [], 1, lambda why: None)
    with pytest.raises(RuntimeError, match="max_model_len 100000 exceeds the model's 512"):
        client.wait_ready()
    client.shutdown()
    assert client.proc.exitcode == 1
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's 512"):
        AsyncLLM(bad)
    assert _spawned_children(os.getpid()) == []


def test_the_server_runs_its_core_in_a_process_of_its_own(server):
    (core,) = _spawned_children(server.proc.pid)
    with open(f"/proc/{core}/maps") as f:  # the KV pool is mapped by the core, not the server
        assert "/dev/zero (deleted)" in f.read()
    body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_a_dead_core_means_503_then_a_non_zero_exit(server):
    (core,) = _spawned_children(server.proc.pid)
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 3}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    os.kill(core, signal.SIGKILL)
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and time.monotonic() - t0 < 5, r.text
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert "exit code -9" in r.json()["error"]["message"]
    try:
        code = server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the server kept running without its engine")
    assert code != 0
    assert "the engine stopped" in server.log.read_text()
