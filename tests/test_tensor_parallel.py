"""Tensor parallelism on CPU (gloo): sharded layers equal the full ones, TP=2 generates the
same greedy tokens as TP=1, and a dead worker fails requests quickly without orphans.

Every spawned rank imports torch (seconds each), so the tests share processes where they can.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp


def _layers_rank(rank: int, world: int, init_file: str) -> None:
    import torch.nn.functional as F

    from pagedllm.distributed import destroy_distributed, init_distributed
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedllm.model_executor.layers.parallel import ParallelLMHead, VocabParallelEmbedding

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
    from pagedllm.model_executor.layers.sharding import head_partition

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


def _assert_tp2_equals_tp1(path: str, **engine_kw) -> None:
    """Greedy tokens through LLM with two worker processes equal one in-process engine's,
    and the workers are gone after shutdown."""
    from pagedllm import LLM

    kw = dict(skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128, **engine_kw)
    want = _greedy(LLM(path, **kw))
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        assert _greedy(llm) == want
    finally:
        pids = llm.engine.executor.worker_pids
        llm.engine.shutdown()
    assert _alive(pids) == []


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", {"num_key_value_heads": 1}),  # GQA, the one KV head replicated on both ranks
    ("qwen2", {}),  # q/k/v bias, 2 KV heads split one per rank
])
def test_tp2_greedy_equals_tp1(tiny_models, model_type, overrides):
    path, _ = tiny_models(model_type, **overrides)
    _assert_tp2_equals_tp1(path)


def test_tp2_fp8_kv_cache_greedy_equals_tp1(tiny_models):
    """FP8 pages under tensor parallelism: each rank quantizes its own KV heads with the
    layer's scales, so the tokens are those of one rank holding every head."""
    path, _ = tiny_models("llama", num_key_value_heads=2)
    _assert_tp2_equals_tp1(path, kv_cache_dtype="fp8")


def test_tp2_remote_code_model_from_its_original_layout(tiny_models, tmp_path):
    """InternLM2's grouped wqkv, converted from a Llama reference, shards like the rest."""
    import remote_code_converters as converters

    _, hf = tiny_models("llama", num_key_value_heads=2)
    path = converters.to_internlm2(hf, str(tmp_path / "internlm2"))
    _assert_tp2_equals_tp1(path)


def test_killed_worker_fails_the_run_quickly_and_leaves_no_orphans(tiny_models):
    import signal
    import time

    from pagedllm import LLM, SamplingParams
    from pagedllm.executor import ExecutorDeadError

    path, _ = tiny_models("llama")
    llm = LLM(path, tensor_parallel_size=2, skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    executor = llm.engine.executor
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
        assert type(llm.engine.executor).__name__ == "RayExecutor"
        assert _greedy(llm, max_tokens=6) == want
        pids = llm.engine.executor.worker_pids
        llm.engine.shutdown()
        assert _alive(pids) == []
    finally:
        ray.shutdown()


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
    from server_process import descendants

    from pagedllm import LLM, SamplingParams
    from pagedllm.config import default_model_path
    from pagedllm.tokenizers import gguf_tokenizer

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
        workers = descendants(proc.pid)  # the engine core process and its TP workers
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want

        def spawned(pids: list[int]) -> list[int]:
            return [p for p in pids if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]

        (core,) = spawned(descendants(proc.pid, depth=1))
        tp_workers = spawned(descendants(core))
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


# ---------------------------------------------------------------------- sharding on read
class _CountingSafeOpen:
    """safetensors.safe_open, recording the shape of every block read out of the file:
    (tensor name, its full shape, the shape read)."""

    real = None  # the original safe_open, set by the fixture

    def __init__(self, reads: list, *args, **kwargs):
        self.reads, self.handle = reads, type(self).real(*args, **kwargs)

    def __enter__(self):
        self.st = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.st.keys()

    def get_tensor(self, name):
        t = self.st.get_tensor(name)
        self.reads.append((name, tuple(t.shape), tuple(t.shape)))
        return t

    def get_slice(self, name):
        reads, sl = self.reads, self.st.get_slice(name)

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, index):
                t = sl[index]
                reads.append((name, tuple(sl.get_shape()), tuple(t.shape)))
                return t

        return Slice()


@pytest.fixture
def rank1_of_2(monkeypatch):
    """Build layers as rank 1 of 2 in this process (no process group: loading needs none),
    with every block read from a safetensors file recorded."""
    import functools

    import safetensors
    import safetensors.torch  # noqa: F401  (binds the real safe_open for load_file/save_file)

    from pagedllm.distributed import parallel_state

    reads: list = []
    monkeypatch.setattr(_CountingSafeOpen, "real", safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", functools.partial(_CountingSafeOpen, reads))
    monkeypatch.setattr(parallel_state, "_state", parallel_state._State(1, 2))
    return reads


def _load_as_rank(path: str):
    from pagedllm.attention import get_attention_backend
    from pagedllm.model_executor.loader import load_model, resolve_source
    from pagedllm.model_executor.loader.loader import load_hf_config

    source = resolve_source(path)
    cpu = torch.device("cpu")
    return load_model(source, load_hf_config(source), 64, get_attention_backend(cpu), cpu, torch.float32)


def test_loader_reads_only_the_ranks_slice(tiny_models, rank1_of_2):
    """Each rank reads its block of every sharded tensor straight from the file (safetensors
    get_slice): half of each projection, embedding and head; only norms are read whole."""
    from safetensors.torch import load_file

    path, _ = tiny_models("llama", num_key_value_heads=2)
    model = _load_as_rank(path)
    reads = rank1_of_2
    assert reads and len({name for name, _, _ in reads}) == len(reads)  # each tensor read once
    for name, full, got in reads:
        assert math.prod(full) == (1 if "norm" in name else 2) * math.prod(got), name
    full = load_file(f"{path}/model.safetensors")
    layer = model.model.layers[1]
    torch.testing.assert_close(layer.self_attn.o_proj.weight, full["model.layers.1.self_attn.o_proj.weight"][:, 32:])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight,
                               torch.cat([full[f"model.layers.1.mlp.{p}_proj.weight"][64:] for p in ("gate", "up")]))
    torch.testing.assert_close(model.lm_head.weight, full["lm_head.weight"][128:])


def test_quantized_loader_reads_only_the_ranks_slice(tmp_path, rank1_of_2):
    """Packed tensors are cut on read too: qweight/scales/qzeros by packed output columns
    (column-parallel) or by packed input rows and whole groups (row-parallel); the rank's
    layers dequantize to its slice of the checkpoint's weights."""
    from hf_models import save_tiny_model
    from quant_packers import GPTQSpec, write_quantized_checkpoint

    hf = save_tiny_model(str(tmp_path / "float"), "llama", hidden_size=128, intermediate_size=256)
    ref = write_quantized_checkpoint(hf, str(tmp_path / "gptq"), GPTQSpec(4, 32, sym=False))
    model = _load_as_rank(str(tmp_path / "gptq"))
    for name, full, got in rank1_of_2:
        # whole: norms, and g_idx of column-parallel layers (they read every input)
        whole = "norm" in name or (name.endswith(".g_idx") and not any(r in name for r in ("o_proj", "down_proj")))
        assert math.prod(full) == (1 if whole else 2) * math.prod(got), name
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    w = lambda n: ref[f"model.layers.0.{n}.weight"]  # noqa: E731
    torch.testing.assert_close(attn.o_proj.dequantized_weight(), w("self_attn.o_proj")[:, 64:])
    torch.testing.assert_close(mlp.down_proj.dequantized_weight(), w("mlp.down_proj")[:, 128:])
    torch.testing.assert_close(attn.qkv_proj.dequantized_weight(),
                               torch.cat([w("self_attn.q_proj")[64:], w("self_attn.k_proj")[32:],
                                          w("self_attn.v_proj")[32:]]))


# ---------------------------------------------------------------------- quantized weights
def _as_rank(monkeypatch, rank: int, world: int = 2) -> None:
    from pagedllm.distributed import parallel_state

    monkeypatch.setattr(parallel_state, "_state", parallel_state._State(rank, world))


def _quantized(spec, k: int, n: int):
    """(checkpoint tensors, the float weight they encode) of one random [n, k] layer."""
    import numpy as np
    from quant_packers import GPTQSpec, quantize_awq, quantize_gptq

    w = np.random.default_rng(0).normal(size=(n, k)).astype(np.float32)
    if isinstance(spec, GPTQSpec):
        tensors, deq = quantize_gptq(w, spec, np.random.default_rng(1).permutation(k))
    else:
        tensors, deq = quantize_awq(w, spec)
    return {name: torch.from_numpy(np.ascontiguousarray(v)) for name, v in tensors.items()}, torch.from_numpy(deq)


def _quant_config(spec, desc_act: bool | None = None):
    from quant_packers import GPTQSpec

    from pagedllm.model_executor.layers.quantization import QuantConfig

    if isinstance(spec, GPTQSpec):
        return QuantConfig("gptq", spec.bits, spec.group_size, spec.checkpoint_format,
                           desc_act=spec.act_order if desc_act is None else desc_act)
    return QuantConfig("awq", 4, spec.group_size, "awq" if spec.version == "gemm" else "awq_gemv")


def _quant_layer_specs():
    from quant_packers import AWQSpec, GPTQSpec

    return [GPTQSpec(4, 32, act_order=True), GPTQSpec(8, 64, sym=False, act_order=True),
            GPTQSpec(4, -1, act_order=True), GPTQSpec(2, 32, sym=False, checkpoint_format="gptq_v2"),
            AWQSpec(32), AWQSpec(32, version="gemv")]


@pytest.mark.parametrize("spec", _quant_layer_specs(), ids=repr)
def test_packed_layer_shards_are_slices_of_the_full_layer(monkeypatch, spec):
    """Column-parallel ranks hold their output features, row-parallel ranks their input
    features (act-order rows keep their group index into the whole table)."""
    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    k, n = 256, 64
    tensors, deq = _quantized(spec, k, n)
    act_order = getattr(spec, "act_order", False) and spec.group_size != -1
    for rank in range(2):
        _as_rank(monkeypatch, rank)
        col = ColumnParallelLinear(k, n, False, _quant_config(spec))
        row = RowParallelLinear(k, n, False, _quant_config(spec))
        for layer in (col, row):
            for name, t in tensors.items():
                layer.load_shard(name, None, t)
            layer.finish_loading()
        assert torch.equal(col.dequantized_weight(), deq[rank * n // 2:(rank + 1) * n // 2])
        assert torch.equal(row.dequantized_weight(), deq[:, rank * k // 2:(rank + 1) * k // 2])
        assert (row.groups is not None) == act_order
        assert row.qweight.shape == (k // 2 * getattr(spec, "bits", 4) // 32, n)  # only its rows read


def test_act_order_config_with_groups_in_order_keeps_only_the_ranks_groups(monkeypatch):
    """desc_act=true with g_idx in group order (static groups): the row-parallel rank
    cuts the group table to its own groups and keeps the kernel's layout."""
    from quant_packers import GPTQSpec

    from pagedllm.model_executor.layers.linear import RowParallelLinear

    spec = GPTQSpec(4, 32, sym=False)
    tensors, deq = _quantized(spec, 256, 64)
    _as_rank(monkeypatch, 1)
    layer = RowParallelLinear(256, 64, False, _quant_config(spec, desc_act=True))
    for name, t in tensors.items():
        layer.load_shard(name, None, t)
    layer.finish_loading()
    assert layer.groups is None and layer.scales.shape == (4, 64)
    assert torch.equal(layer.dequantized_weight(), deq[:, 128:])


def test_packed_layouts_that_cannot_be_split_fail_clearly(monkeypatch):
    from quant_packers import GPTQSpec

    from pagedllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from pagedllm.model_executor.layers.quantization import QuantConfig

    _as_rank(monkeypatch, 0)
    with pytest.raises(ValueError, match="whole groups"):  # 64 inputs a rank, groups of 128
        RowParallelLinear(128, 64, False, QuantConfig("gptq", 4, 128))
    with pytest.raises(ValueError, match="divisible by 8 on each of 2 ranks"):
        ColumnParallelLinear(64, 40, False, QuantConfig("awq", 4, 32, "awq"))
    spec = GPTQSpec(4, 32, act_order=True)  # act-order g_idx, but the config says desc_act=false
    tensors, _ = _quantized(spec, 256, 64)
    layer = RowParallelLinear(256, 64, False, _quant_config(spec, desc_act=False))
    for name, t in tensors.items():
        layer.load_shard(name, None, t)
    with pytest.raises(ValueError, match="desc_act"):
        layer.finish_loading()


def _quant_model_specs():
    from quant_packers import AWQSpec, GPTQSpec

    return [GPTQSpec(4, 32, sym=False, act_order=True, lm_head=True), AWQSpec(64, not_converted=("mlp.down_proj",))]


@pytest.mark.parametrize("spec", _quant_model_specs(), ids=repr)
def test_tp2_quantized_greedy_equals_tp1(tmp_path, spec):
    """A GPTQ checkpoint (act-order, quantized head) and an AWQ one (with a layer left in
    float) generate the same greedy tokens split over two ranks as on one."""
    from hf_models import save_tiny_model
    from quant_packers import write_quantized_checkpoint

    hf = save_tiny_model(str(tmp_path / "float"), "llama", hidden_size=128, intermediate_size=256)
    path = str(tmp_path / "quantized")
    write_quantized_checkpoint(hf, path, spec)
    _assert_tp2_equals_tp1(path)
