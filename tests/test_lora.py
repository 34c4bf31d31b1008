"""Multi-LoRA serving: requests of several PEFT adapters and of the base model share one
batch, and each one's greedy tokens equal transformers + PEFT with that adapter applied.
Also: more adapters than slots in one call (LRU swapping), prefix-cache isolation
between adapters, the errors a bad adapter gets, and the Triton kernels against the
torch path (interpreted on the CPU)."""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
import torch
from hf_models import hf_greedy
from interpreted import run_interpreted
from lora_adapters import make_adapter, set_rank_in_config

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler

MAX_NEW = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(4, 20))] for _ in range(n)]


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """arch -> (base path, base HF model, [(LoRARequest, PEFT reference model)])."""
    cache: dict = {}

    def get(arch: str, count: int = 3):
        if arch not in cache:
            path, hf = tiny_models(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            made = []
            for i in range(count):
                d = str(root / f"a{i}")
                # different ranks, targets and scalings (rsLoRA on one, per-module rank and
                # alpha patterns on another)
                targets = None if i != 1 else ["q_proj", "v_proj", "down_proj"]
                patterns = {} if i != 1 else {"rank_pattern": {"v_proj": 2},
                                              "alpha_pattern": {"down_proj": 24}}
                ref = make_adapter(hf, d, seed=10 + i, r=(8, 4, 16)[i % 3], alpha=(16, 8, 4)[i % 3],
                                   targets=targets, rslora=i == 2, **patterns)
                made.append((LoRARequest(f"a{i}", i + 1, d), ref))
            cache[arch] = (path, hf, made)
        return cache[arch]

    return get


def _check_mixed(llm: LLM, hf, made, prompts) -> None:
    choices = [None] + [lora for lora, _ in made]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    refs = {None: hf, **{lora.lora_int_id: ref for lora, ref in made}}
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    differs = 0
    for p, lora, out in zip(prompts, loras, outs, strict=True):
        ref = refs[lora.lora_int_id if lora else None]
        want, want_lps = hf_greedy(ref, p, MAX_NEW)
        got = out.outputs[0]
        assert got.token_ids == want, (lora, p)
        lps = [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert lps == pytest.approx(want_lps, abs=1e-3)
        if lora is not None:
            differs += hf_greedy(hf, p, MAX_NEW)[0] != want
    assert differs >= len(made)  # the adapters really change the answers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(adapters, arch):
    path, hf, made = adapters(arch)
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              enable_lora=True, max_loras=3, max_lora_rank=16)
    _check_mixed(llm, hf, made, _prompts(6, seed=1))


def test_more_adapters_than_slots(adapters):
    """Three adapters, two slots, one call: the scheduler keeps a step to two adapters and
    the worker swaps them in and out of the slots (LRU from its CPU cache)."""
    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    _check_mixed(llm, hf, made, _prompts(6, seed=2))
    manager = llm.engine.executor.runner.lora
    assert manager.num_loads == len(made)
    _check_mixed(llm, hf, made[::-1], _prompts(4, seed=3))
    assert manager.num_loads > len(made)  # an adapter came back after being swapped out
    assert len(manager.cpu) == 2


def test_parity_under_preemption(adapters):
    """A pool too small for the batch: requests of different adapters are preempted and
    recomputed (their prefix-cache hits under their own adapter), tokens unchanged."""
    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=16,
              enable_lora=True, max_loras=3, max_lora_rank=16)
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(28)] for _ in range(4)]
    _check_mixed(llm, hf, made, prompts)
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_prefix_cache_is_per_adapter(adapters):
    """The same prompt under two adapters and the base model: no KV page is shared
    between them, while a repeat under the same adapter hits the cache."""
    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = {"prompt_token_ids": list(range(3, 27))}  # 6 full blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (a, _), (b, ref_b) = made[0], made[2]
    llm.generate(prompt, params, lora_request=a)
    kv = llm.engine.kv
    hits0 = kv.prefix_hits
    out_b = llm.generate(prompt, params, lora_request=b)[0]
    out_base = llm.generate(prompt, params)[0]
    assert kv.prefix_hits == hits0  # neither took the pages of adapter a
    assert out_b.outputs[0].token_ids == hf_greedy(ref_b, prompt["prompt_token_ids"], 4)[0]
    assert out_base.outputs[0].token_ids == hf_greedy(hf, prompt["prompt_token_ids"], 4)[0]
    again = llm.generate(prompt, params, lora_request=b)[0]
    assert kv.prefix_hits > hits0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == out_b.outputs[0].token_ids


def test_errors(adapters, tiny_models, tmp_path):
    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=64,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    p = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(temperature=0, max_tokens=3)
    big = made[2][0]  # rank 16 > 8
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm.generate(p, params, lora_request=big)
    with pytest.raises(ValueError, match="no such directory"):
        llm.generate(p, params, lora_request=LoRARequest("x", 9, str(tmp_path / "nope")))
    # a module no LoRA layer serves
    odd = tmp_path / "odd"
    make_adapter(hf, str(odd), seed=3, r=4, targets=["lm_head"])
    with pytest.raises(ValueError, match="target module 'lm_head'"):
        llm.generate(p, params, lora_request=LoRARequest("odd", 7, str(odd)))
    # a projection of the right kind in a layer this model does not have
    _, deeper = tiny_models("llama", num_hidden_layers=3)
    extra = tmp_path / "extra-layer"
    make_adapter(deeper, str(extra), seed=6, r=4, targets=["q_proj"])
    with pytest.raises(ValueError, match="no LoRA layer for target module model.layers.2"):
        llm.generate(p, params, lora_request=LoRARequest("extra", 10, str(extra)))
    # a config PEFT features the engine does not serve
    dora = tmp_path / "dora"
    make_adapter(hf, str(dora), seed=4, r=4)
    set_rank_in_config(str(dora), use_dora=True)
    with pytest.raises(ValueError, match="use_dora"):
        llm.generate(p, params, lora_request=LoRARequest("dora", 8, str(dora)))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, str(dora))
    # the engine still serves, base and adapter alike
    ok = made[1]
    out = llm.generate(p, params, lora_request=[ok[0]])[0]
    assert out.outputs[0].token_ids == hf_greedy(ok[1], [1, 2, 3], 3)[0]
    assert llm.generate(p, params)[0].outputs[0].token_ids == hf_greedy(hf, [1, 2, 3], 3)[0]
    off = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        off.generate(p, params, lora_request=ok[0])


def test_scheduler_caps_adapters_per_step():
    """Pure core: with 2 slots, running requests never span 3 adapters; the request of a
    third adapter waits while later ones of running adapters go ahead."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64, max_loras=2)
    for i, lid in enumerate([1, 2, 3, 1, 0]):
        s.add_request(Request(f"r{i}", [5, 6, 7], 4, lora_int_id=lid))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in s.waiting] == ["r2"]
    assert {r.lora_int_id for r in s.running} == {0, 1, 2}


def test_block_hashes_depend_on_adapter():
    kv = KVCacheManager(64, 4)
    reqs = [Request(f"r{lid}", list(range(9)), 4, lora_int_id=lid) for lid in (0, 1, 2)]
    for r in reqs:
        kv.get_computed_blocks(r)
    hashes = [tuple(r.block_hashes) for r in reqs]
    assert len(set(hashes)) == 3 and all(len(h) == 2 for h in hashes)


def _kernel_case(m: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 only: int | None = None, r: int = 24, n: int = 70, block_n: int | None = None,
                 prefill_split: int | None = None):
    """The kernels against the torch path (in float32), and that against a per-token loop.
    `only`: every token on that one slot (-1: none has an adapter; the tile table is then
    all unused entries). `block_n`: the expand's output tile width for this case (narrow
    tiles make several per program: the expand's grouping, a part-filled last group).
    `prefill_split`: the most K slices of a shrink over 256 rows (SHRINK_PREFILL_SPLIT_K;
    None: the module's)."""
    from pagedllm.model_executor.lora import triton_ops
    from pagedllm.model_executor.lora.layers import LoRABatch, lora_delta_torch
    from pagedllm.model_executor.lora.triton_ops import lora_expand, lora_shrink

    gen = torch.Generator().manual_seed(0)
    slots_n = 3
    x = torch.randn(m, k, generator=gen) / k**0.5
    a, b = torch.randn(slots_n, r, k, generator=gen), torch.randn(slots_n, n, r, generator=gen)
    slots = np.random.default_rng(0).integers(-1, slots_n, m).astype(np.int32)
    if only is not None:
        slots[:] = only
    batch = LoRABatch(slots_n, m, torch.device(device))
    batch.set(slots, m)
    base = torch.randn(m, n, generator=gen)
    dev = [t.to(device, dtype) for t in (x, a, b, base)]
    default_bn, default_split = triton_ops.EXPAND_BLOCK_N, triton_ops.SHRINK_PREFILL_SPLIT_K
    triton_ops.EXPAND_BLOCK_N = block_n or default_bn
    triton_ops.SHRINK_PREFILL_SPLIT_K = prefill_split or default_split
    try:
        if block_n:  # the case does group output tiles
            n_tiles = -(-n // block_n)
            assert triton_ops.expand_group(batch.tile_slot.numel(), n_tiles, dev[0].device) > 1
        y = lora_expand(lora_shrink(dev[0], dev[1], batch), dev[2], dev[3].clone(), batch).cpu().float()
    finally:
        triton_ops.EXPAND_BLOCK_N, triton_ops.SHRINK_PREFILL_SPLIT_K = default_bn, default_split
    ref = base + lora_delta_torch(x, a, b, batch.token_slot.cpu())
    assert torch.equal(y[slots < 0], dev[3].cpu().float()[slots < 0])  # base rows untouched
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())
    # the torch path itself against a plain per-token loop
    for t in range(m):
        if slots[t] >= 0:
            want = base[t] + b[slots[t]] @ (a[slots[t]] @ x[t])
            torch.testing.assert_close(ref[t], want, rtol=1e-4, atol=1e-3)


def _engine_triton_case(root: str) -> None:
    """A whole engine on the Triton kernels (interpreted on the CPU): three adapters over
    two slots and the base model, greedy tokens equal PEFT's."""
    from hf_models import save_tiny_model

    hf = save_tiny_model(os.path.join(root, "base"), "llama")
    made = [(LoRARequest(f"a{i}", i + 1, os.path.join(root, f"a{i}")),
             make_adapter(hf, os.path.join(root, f"a{i}"), seed=30 + i, r=4 + 4 * i)) for i in range(3)]
    llm = LLM(model=os.path.join(root, "base"), device="cpu", skip_tokenizer_init=True, block_size=4,
              num_kv_blocks=128, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.engine.executor.runner.lora.batch.use_triton = True
    prompts = _prompts(4, seed=9)
    choices = [None] + [lora for lora, _ in made]
    refs = {None: hf, **{lora.lora_int_id: ref for lora, ref in made}}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=choices)
    for p, lora, out in zip(prompts, choices, outs, strict=True):
        ref = refs[lora.lora_int_id if lora else None]
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 5)[0], lora


def test_triton_kernels_interpreted(tmp_path):
    """The shrink/expand kernels, run by Triton's interpreter on the CPU in float32, equal
    the torch path (decode-sized and prefill-sized steps, K split over programs or not;
    output tiles grouped per expand program, with a rank that fits one K step and one that
    does not); and the whole engine on them (LoRABatch's grouped tokens, the layers' CUDA
    path) equals PEFT. In a subprocess: TRITON_INTERPRET is read when Triton
    is imported."""
    pytest.importorskip("triton")
    code = ("import sys; sys.path.insert(0, 'tests'); import test_lora; "
            "test_lora._kernel_case(37, 1100); test_lora._kernel_case(300, 40); "
            "test_lora._kernel_case(300, 1100, prefill_split=1); test_lora._kernel_case(300, 1100); "
            "test_lora._kernel_case(40, 64, only=2); test_lora._kernel_case(300, 64, only=-1); "
            "test_lora._kernel_case(37, 1100, n=150, block_n=16); "
            "test_lora._kernel_case(37, 300, r=80, n=150, block_n=16); "
            f"test_lora._engine_triton_case({str(tmp_path)!r}); print('ok')")
    res = run_interpreted(["-c", code], 300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_shrink_split_fills_the_gpu(monkeypatch):
    """K slices per shrink program on a 132-SM card, for the steps the H100 measurements
    chose them by (lora_kernel_bench): 256 decodes (20 table entries) split 8 ways at
    K 4,096; decodes with a 512-token chunk (16 entries of 64 rows) 16 ways; an 8,192-token
    chunk (132 entries) 2 ways; never past the cap or under 4 K steps a slice."""
    pytest.importorskip("triton")
    from pagedllm.model_executor.lora import triton_ops

    monkeypatch.setattr(triton_ops, "_num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert triton_ops.shrink_split_k(20, 256, 4096, 128, cpu) == 8
    assert triton_ops.shrink_split_k(20, 256, 11008, 128, cpu) == 14
    assert triton_ops.shrink_split_k(16, 768, 4096, 64, cpu) == 16
    assert triton_ops.shrink_split_k(132, 8192, 4096, 64, cpu) == 2
    assert triton_ops.shrink_split_k(16, 768, 200, 64, cpu) == 1
    monkeypatch.setattr(triton_ops, "SHRINK_PREFILL_SPLIT_K", 4)
    assert triton_ops.shrink_split_k(16, 768, 4096, 64, cpu) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, r, n, block_n", [(37, 4096, 24, 70, None), (300, 1100, 24, 70, None),
                                                 (256, 4096, 48, 12288, 128), (256, 4096, 80, 8192, 128)])
def test_triton_kernels_cuda_bf16(m, k, r, n, block_n):
    _kernel_case(m, k, "cuda", torch.bfloat16, r=r, n=n, block_n=block_n)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_float32_gpu_matches_peft(adapters, arch):
    """CUDA in float32: the Triton kernels (eager prefill, decode in CUDA graphs) give the
    same greedy tokens as PEFT, as the CPU path does; three adapters over two slots."""
    path, hf, made = adapters(arch)
    llm = LLM(model=path, device="cuda", dtype="float32", skip_tokenizer_init=True,
              block_size=16, num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=16)
    assert llm.engine.executor.runner.graphs is not None
    _check_mixed(llm, hf, made, _prompts(8, seed=6))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_bf16_gpu_follows_peft_until_near_tie(adapters, arch):
    """CUDA in bf16 (the serving dtype): each request follows PEFT in bf16 on the same GPU
    token for token until the two disagree where PEFT's own top two logits nearly tie."""
    path, hf, made = adapters(arch)
    llm = LLM(model=path, device="cuda", skip_tokenizer_init=True, block_size=16,
              num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="bfloat16")
    prompts = _prompts(12, seed=5)
    choices = [None] + [lora for lora, _ in made]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    refs = {None: hf, **{lora.lora_int_id: ref for lora, ref in made}}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    for p, lora, out in zip(prompts, loras, outs, strict=True):
        ref = copy.deepcopy(refs[lora.lora_int_id if lora else None]).to("cuda", torch.bfloat16)
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            res = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                               do_sample=False, output_scores=True, return_dict_in_generate=True,
                               pad_token_id=0, eos_token_id=None)
        want = res.sequences[0, len(p):].tolist()
        for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, want, strict=True)):
            if a != b:
                lps = res.scores[i][0].float().log_softmax(-1)
                margin = (lps[b] - lps[a]).item()
                assert margin < 0.1, f"{lora}: diverged at {i} with a clear margin {margin}"
                break


def test_tensor_parallel_matches_peft(adapters):
    """Two CPU ranks (gloo): each holds its block of every adapter, cut like its layers
    (B by output rows on q/k/v and gate/up, A by input columns on o and down)."""
    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=128,
              enable_lora=True, max_loras=2, max_lora_rank=16, tensor_parallel_size=2)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        _check_mixed(llm, hf, made, _prompts(4, seed=4))
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adapter_for_another_model_fails_its_request_alone(adapters, tiny_models, tmp_path,
                                                           async_scheduling):
    """An adapter whose folder looks right but whose shapes fit another model passes the
    front end's header check; the worker refuses it when reading it, and only that
    request ends (with an error), while the others of the same batch finish."""
    path, hf, made = adapters("llama")
    _, other = tiny_models("llama", hidden_size=32)
    wrong = tmp_path / "wrong"
    make_adapter(other, str(wrong), seed=5, r=4)
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=64,
              enable_lora=True, max_loras=2, max_lora_rank=16, async_scheduling=async_scheduling)
    p = [1, 2, 3, 4]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    loras = [made[0][0], LoRARequest("wrong", 9, str(wrong)), None]
    outs = llm.generate([{"prompt_token_ids": p}] * 3, params, lora_request=loras)
    assert outs[1].outputs[0].finish_reason == "error" and "does not fit" in outs[1].error
    assert outs[0].outputs[0].token_ids == hf_greedy(made[0][1], p, 4)[0]
    assert outs[2].outputs[0].token_ids == hf_greedy(hf, p, 4)[0]


def test_batch_invariant_with_adapters(adapters):
    """batch_invariant=True: a request with an adapter gets the same logprob bits alone as
    in a mixed batch of other adapters and the base model."""
    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=128,
              enable_lora=True, max_loras=3, max_lora_rank=16, batch_invariant=True)
    prompt = {"prompt_token_ids": [7, 8, 9, 10, 11, 12]}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    alone = llm.generate(prompt, params, lora_request=made[1][0])[0].outputs[0]
    llm.reset_prefix_cache()
    others = [{"prompt_token_ids": p} for p in _prompts(4, seed=8)]
    mixed = llm.generate([*others[:2], prompt, *others[2:]], params,
                         lora_request=[made[0][0], None, made[1][0], made[2][0], None])[2].outputs[0]
    assert mixed.token_ids == alone.token_ids
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in mixed.logprobs] == \
        [{t: lp.logprob for t, lp in pos.items()} for pos in alone.logprobs]


def test_lora_metric_names_running_and_waiting_adapters(adapters):
    """/metrics' lora_requests_info (vLLM's): one slot, two adapters asked for: one runs,
    the other waits."""
    from prometheus_client import generate_latest

    path, hf, made = adapters("llama")
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=64,
              enable_lora=True, max_loras=1, max_lora_rank=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("x", None, [1, 2, 3], params, made[0][0])
    engine.add_request("y", None, [4, 5, 6], params, made[1][0])
    engine.step()
    text = generate_latest(engine.metrics.registry).decode()
    assert ('pagedllm:lora_requests_info{max_lora="1",running_lora_adapters="a0",'
            'waiting_lora_adapters="a1"}') in text
    while engine.has_unfinished_requests():
        engine.step()
    text = generate_latest(engine.metrics.registry).decode()
    assert 'running_lora_adapters="",waiting_lora_adapters=""' in text
    assert text.count("pagedllm:lora_requests_info{") == 1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_adapters_matches_peft(adapters, method):
    """Verify steps of requests with different adapters: each row's adapter slot covers its
    drafts' positions too (n-gram; a draft model proposes with the base weights), and the
    tokens are PEFT's."""
    path, hf, made = adapters("llama")
    spec = {"num_speculative_tokens": 3, "max_batch_size": 8}
    spec.update({"method": "ngram", "prompt_lookup_min": 1} if method == "ngram" else {"model": path})
    llm = LLM(model=path, device="cpu", skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              enable_lora=True, max_loras=3, max_lora_rank=16, speculative_config=spec)
    rng = random.Random(5)
    loop = [rng.randrange(256) for _ in range(5)] * 3  # repeats: n-gram drafts come up
    _check_mixed(llm, hf, made, [loop, *_prompts(4, seed=4), loop[:7]])
    assert llm.engine.stats().spec_num_draft_tokens > 0
