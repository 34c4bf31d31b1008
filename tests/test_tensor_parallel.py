"""Tensor parallelism on CPU (gloo): sharded layers equal the full ones, TP=2 generates the
same greedy tokens as TP=1, and a dead worker fails requests quickly without orphans.

Every spawned rank imports torch (seconds each), so the tests share processes where they can.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp


def _layers_rank(rank: int, world: int, init_file: str) -> None:
    import torch.nn.functional as F

    from pagedllm.distributed import destroy_distributed, init_distributed
    from pagedllm.model_executor.layers.parallel import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    torch.set_num_threads(1)
    init_distributed(rank, world, f"file://{init_file}", torch.device("cpu"))
    try:
        g = torch.Generator().manual_seed(0)  # same full weights on every rank
        hidden, heads, kv_heads, hd, vocab = 16, 4, 1, 4, 37  # 1 KV head on 2 ranks: replicated
        wq, wk, wv = (torch.randn(n * hd, hidden, generator=g) for n in (heads, kv_heads, kv_heads))
        bq, bk, bv = (torch.randn(n * hd, generator=g) for n in (heads, kv_heads, kv_heads))
        wo, bo = torch.randn(hidden, heads * hd, generator=g), torch.randn(hidden, generator=g)
        emb = torch.randn(vocab, hidden, generator=g)
        ids = torch.tensor([0, 5, 18, 19, 36, 20])

        qkv = ColumnParallelLinear.qkv(hidden, heads, kv_heads, hd, bias=True)
        for name, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            qkv.load_shard("weight", name, w)
            qkv.load_shard("bias", name, b)
        o = RowParallelLinear(heads * hd, hidden, bias=True)
        o.load_shard("weight", None, wo)
        o.load_shard("bias", None, bo)
        embed = VocabParallelEmbedding(vocab, hidden)
        embed.load_shard("weight", None, emb)
        head = ParallelLMHead(vocab, hidden)
        head.load_shard("weight", None, emb)

        x = embed(ids)
        torch.testing.assert_close(x, F.embedding(ids, emb))
        q, k, v = qkv(x).split([heads * hd // world, hd, hd], dim=-1)
        torch.testing.assert_close(q, F.linear(x, wq, bq).chunk(world, -1)[rank])
        torch.testing.assert_close(k, F.linear(x, wk, bk))  # the one KV head, on both ranks
        y = o(q * 2.0)
        torch.testing.assert_close(y, F.linear(F.linear(x, wq, bq) * 2.0, wo, bo), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(head(x), F.linear(x, emb), rtol=1e-4, atol=1e-4)
    finally:
        destroy_distributed()


def test_parallel_layers_equal_full_layers():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_layers_rank, args=(2, os.path.join(d, "rdv")), nprocs=2, join=True)


def test_head_partition_replicates_kv_heads():
    from pagedllm.model_executor.layers.parallel import head_partition

    assert [head_partition(8, r, 4, "h") for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [head_partition(2, r, 4, "h", replicate=True) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="divisible"):
        head_partition(6, 0, 4, "num_attention_heads")
    with pytest.raises(ValueError, match="divisible"):  # query heads are never replicated
        head_partition(2, 0, 4, "num_attention_heads")
    with pytest.raises(ValueError, match="must divide"):
        head_partition(3, 0, 4, "num_key_value_heads", replicate=True)


# ---------------------------------------------------------------------- end to end
PROMPTS = [[1, 5, 9, 200, 31, 7], [3, 3, 90, 14], list(range(40, 75))]  # the last spans blocks


def _greedy(llm, max_tokens: int = 12) -> list[list[int]]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _alive(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of `pids` still running after up to `timeout` seconds (zombies count as gone)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] != "Z":
                        alive.append(pid)
            except FileNotFoundError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {"num_key_value_heads": 1}),  # GQA, the one KV head replicated on both ranks
    ("qwen2", {}),  # q/k/v bias, 2 KV heads split one per rank
])
def test_tp2_greedy_equals_tp1(tiny_models, model_type, overrides):
    from pagedllm import LLM

    path, _ = tiny_models(model_type, **overrides)
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    want = _greedy(LLM(path, **kw))
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert type(llm.engine.runner).__name__ == "MultiprocExecutor"
        assert _greedy(llm) == want
    finally:
        pids = llm.engine.runner.worker_pids
        llm.engine.shutdown()
    assert _alive(pids) == []


def test_tp2_zoo_model_from_its_original_layout(tiny_models, tmp_path):
    """InternLM2's grouped wqkv, converted from a Llama reference, shards like the rest."""
    import zoo_converters as zc

    from pagedllm import LLM

    _, hf = tiny_models("llama", num_key_value_heads=2)
    path = zc.to_internlm2(hf, str(tmp_path / "internlm2"))
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    want = _greedy(LLM(path, **kw))
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert _greedy(llm) == want
    finally:
        pids = llm.engine.runner.worker_pids
        llm.engine.shutdown()
    assert _alive(pids) == []


def test_killed_worker_fails_the_run_quickly_and_leaves_no_orphans(tiny_models):
    import signal
    import time

    from pagedllm import LLM, SamplingParams
    from pagedllm.executor import ExecutorDeadError

    path, _ = tiny_models("llama")
    llm = LLM(path, tensor_parallel_size=2, skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    executor = llm.engine.runner
    pids = executor.worker_pids
    execute, steps = executor.execute, []

    def kill_on_third_step(so):  # mid-run: after prefill and a decode step
        steps.append(so)
        if len(steps) == 3:
            os.kill(pids[1], signal.SIGKILL)
        return execute(so)

    executor.execute = kill_on_third_step
    t0 = time.monotonic()
    with pytest.raises(ExecutorDeadError, match=r"rank 1 died \(pid \d+, exit code -9\)"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=100, ignore_eos=True))
    assert time.monotonic() - t0 < 15 and len(steps) == 3
    assert _alive(pids) == []  # rank 0 was stopped too, without an explicit shutdown
    with pytest.raises(ExecutorDeadError):  # and the engine stays failed, it does not hang
        llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2))
    llm.engine.shutdown()  # idempotent


def test_ray_backend_places_the_same_workers_as_actors(tiny_models):
    ray = pytest.importorskip("ray")
    from pagedllm import LLM

    path, _ = tiny_models("qwen2")
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    want = _greedy(LLM(path, **kw), max_tokens=6)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **kw)
        assert type(llm.engine.runner).__name__ == "RayExecutor"
        assert _greedy(llm, max_tokens=6) == want
        pids = llm.engine.runner.worker_pids
        llm.engine.shutdown()
        assert _alive(pids) == []
    finally:
        ray.shutdown()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(")")[-1].split()[1]) == pid:
                        kids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return kids


def test_server_tp2_serves_then_fails_clearly_when_a_worker_dies(tmp_path):
    """One server: --tensor-parallel-size 2 answers like TP=1; after a worker is killed the
    next request gets 503 engine_unavailable at once, and stopping the server leaves no
    worker behind."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx
    from hf_models import save_tiny_model

    from pagedllm import LLM, SamplingParams
    from pagedllm.config import default_model_path
    from pagedllm.model_executor.loader.gguf_file import gguf_tokenizer

    tok = gguf_tokenizer(default_model_path())  # a real tokenizer for a tiny random model
    path = str(tmp_path / "model")
    save_tiny_model(path, "llama", vocab_size=len(tok))
    tok.save_pretrained(path)
    prompt = "The capital of France is"
    want = LLM(path, num_kv_blocks=32, max_model_len=128).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", path, "--host", "127.0.0.1",
           "--port", str(port), "--tensor-parallel-size", "2", "--num-kv-blocks", "32",
           "--max-model-len", "128", "--served-model-name", "tiny", "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        workers = _children(proc.pid)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want

        tp_workers = [p for p in workers if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(tp_workers) == 2
        os.kill(tp_workers[-1], signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and time.monotonic() - t0 < 15, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert _alive(workers) == []


def test_quantized_checkpoints_refuse_tp_clearly(monkeypatch):
    from hf_models import make_config

    from pagedllm.model_executor.layers.quantization import QuantConfig
    from pagedllm.model_executor.models import llama

    monkeypatch.setattr(llama, "get_tp_world_size", lambda: 2)
    with pytest.raises(NotImplementedError, match="tensor_parallel_size > 1 with a GPTQ checkpoint"):
        llama.ModelShape(make_config("llama"), "LlamaForCausalLM", QuantConfig.default("gptq"))
