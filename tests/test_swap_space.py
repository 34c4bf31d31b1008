"""Swapped preemption (swap_space): a preempted sequence's pages go to host blocks and come
back when it resumes, instead of being recomputed. The scheduler's side (which victims are
swapped, the host runs, the copies a step carries), and a whole engine on the CPU whose
greedy tokens and logprobs under preemption equal HF transformers' and the recomputing
engine's, with fewer tokens computed."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core import scheduler as scheduler_mod
from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import HostBlocks, Scheduler


def test_host_blocks_first_fit_and_merge():
    h = HostBlocks(10)
    a, b, c = h.alloc(4), h.alloc(3), h.alloc(3)
    assert (a, b, c) == (0, 4, 7) and h.alloc(1) is None and h.num_free == 0
    h.free(b, 3)
    assert h.alloc(4) is None  # three free blocks in one run
    h.free(a, 4)  # merges with the freed run after it: 7 in a row
    assert h.alloc(7) == 0 and h.num_free == 0
    h.free(0, 7)
    h.free(c, 3)
    assert h._free == [(0, 10)]
    with pytest.raises(AssertionError):
        h.free(2, 2)  # already free


def _two_growing(swap_blocks: int) -> tuple[KVCacheManager, Scheduler]:
    """Two 16-token prompts (4 blocks of 4 each) that grow past a 12-block pool."""
    kv = KVCacheManager(12, 4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024, swap_blocks=swap_blocks)
    for i in range(2):
        s.add_request(Request(request_id=f"r{i}", prompt_token_ids=[1 + i] * 16, max_tokens=20, ignore_eos=True))
    return kv, s


def _grow(s: Scheduler, steps: int) -> list:
    """Run `steps` steps, every scheduled chunk sampling token 5; the outputs."""
    outs = []
    for _ in range(steps):
        out = s.schedule()
        outs.append(out)
        s.update(out, {c.request_id: 5 for c in out.chunks if c.sample})
    return outs


def test_victims_are_swapped_out_and_back_with_their_tokens(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "SWAP_MIN_TOKENS", 8)
    kv, s = _two_growing(8)
    outs = _grow(s, 12)
    swapped = [o for o in outs if o.swap_out]
    assert swapped and s.num_swapped_out_total >= 1
    ids, start = swapped[0].swap_out[0]
    victim = next(r for r in s.requests.values() if r.num_preemptions)
    # the victim's computed pages: whole blocks up to its computed tokens, one host run
    assert victim.swapped is None or victim.swapped[:2] == (start, len(ids))
    back = [o for o in outs if o.swap_in]
    if not back:  # resumes once the other finishes
        outs += _grow(s, 40)
        back = [o for o in outs if o.swap_in]
    (hstart, new_ids), = back[0].swap_in
    assert hstart == start and len(new_ids) == len(ids)
    chunk = next(c for c in back[0].chunks if c.request_id == victim.request_id)
    assert chunk.full_table and chunk.start >= 8  # resumed past its swapped tokens, not from 0
    assert chunk.new_block_ids[: len(new_ids)] == new_ids
    _grow(s, 60)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in s.requests.values())
    assert s.host.num_free == 8 and kv.num_free_blocks == 12
    assert all(r.num_output_tokens == 20 for r in s.requests.values())


def test_short_victims_and_a_full_swap_space_recompute(monkeypatch):
    _, s = _two_growing(8)
    outs = _grow(s, 12)  # victims hold ~20 tokens, under SWAP_MIN_TOKENS (256)
    assert s.num_preemptions_total and not any(o.swap_out for o in outs) and s.num_swapped_out_total == 0
    monkeypatch.setattr(scheduler_mod, "SWAP_MIN_TOKENS", 8)
    _, s = _two_growing(2)
    outs = _grow(s, 12)  # 2 host blocks hold no victim of 4+ blocks
    assert s.num_preemptions_total and not any(o.swap_out for o in outs)


def test_a_swapped_request_that_ends_frees_its_host_blocks(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "SWAP_MIN_TOKENS", 8)
    _, s = _two_growing(8)
    for _ in range(30):
        out = s.schedule()
        s.update(out, {c.request_id: 5 for c in out.chunks if c.sample})
        victim = next((r for r in s.requests.values() if r.swapped is not None), None)
        if victim is not None:
            break
    assert victim is not None and s.host.num_free < 8
    s.abort(victim.request_id)
    assert s.host.num_free == 8 and victim.swapped is None


def _prompts(n: int, seed: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_with_swap_space_matches_hf_and_recomputes_less(tiny_models, monkeypatch, async_scheduling, device):
    """28-token prompts of 7 blocks grow to 10 (block 4, 16-block pool): the newer of two is
    preempted; with a swap space its pages come back instead of being read again. On CUDA
    (float32, pinned host pages, the copies in the stream's order) greedy tokens equal HF's
    and the logprobs equal the recomputing engine's on the same card."""
    monkeypatch.setattr(scheduler_mod, "SWAP_MIN_TOKENS", 8)
    path, hf = tiny_models("llama")
    prompts = _prompts(6, seed=2, length=28)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    tokens, logprobs = {}, {}
    for swap in (0.0, 1e-3):  # 1e-3 GiB: about a megabyte, dozens of this model's blocks
        llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=16, device=device,
                  dtype="float32", enable_prefix_caching=False, swap_space=swap,
                  async_scheduling=async_scheduling)
        computed = []
        step = llm.engine.executor.launch if async_scheduling else llm.engine.executor.execute

        def spy(so, *a, step=step, computed=computed, **k):
            computed.append(sum(c.num_tokens for c in so.chunks))
            return step(so, *a, **k)

        if async_scheduling:
            llm.engine.executor.launch = spy
        else:
            llm.engine.executor.execute = spy
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        sched = llm.engine.scheduler
        assert sched.num_preemptions_total > 0
        assert (sched.num_swapped_out_total > 0) == (swap > 0)
        logprobs[swap] = []
        for p, o in zip(prompts, outs, strict=True):
            ref_tokens, ref_lps = hf_greedy(hf, p, 12)
            got = o.outputs[0]
            assert got.token_ids == ref_tokens
            lps = [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids, strict=True)]
            logprobs[swap].append(lps)
            if device == "cpu":
                assert lps == pytest.approx(ref_lps, abs=1e-4)
        assert llm.engine.kv.num_free_blocks == 16
        if swap:
            assert sched.host.num_free == sched.host.num_blocks
        tokens[swap] = sum(computed)
    assert tokens[1e-3] < tokens[0.0]  # the swapped sequences were not read again
    for a, b in zip(logprobs[0.0], logprobs[1e-3], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_tensor_parallel_workers_swap_their_shards(tiny_models, monkeypatch):
    """Two CPU worker processes (TP=2): each copies its own heads' pages out and back; the
    tokens equal one process's without a swap space."""
    monkeypatch.setattr(scheduler_mod, "SWAP_MIN_TOKENS", 8)
    path, _ = tiny_models("llama")
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, seed=5, length=28)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=16, enable_prefix_caching=False, device="cpu")
    want = LLM(model=path, **kw).generate(prompts, params)
    llm = LLM(model=path, tensor_parallel_size=2, swap_space=1e-3, **kw)
    try:
        got = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_swapped_out_total > 0
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
