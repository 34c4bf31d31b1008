"""A long prompt must not stall the streams that decode beside it (no torch, no model).

While decodes run, every step carries all of them plus at most
`max_prefill_tokens_with_decodes` prompt tokens, so a 32k prompt is read in
ceil(32768 / cap) steps of bounded size; with no decode running the prompt gets the whole
token budget. The invariants under random workloads are in test_core_properties.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pagedllm.config import DEFAULT_PREFILL_TOKENS_WITH_DECODES, EngineConfig
from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler

LONG = 32768
BUDGET = 8192
CAP = 512


def step(sched: Scheduler, token: int = 7):
    """One step with a fake model that samples `token` for every sequence due a token."""
    out = sched.schedule()
    sched.update(out, {c.request_id: token for c in out.chunks if c.sample})
    return out


def running_decodes(sched: Scheduler, n: int, prompt_len: int = 8) -> list[Request]:
    """n requests past their prefill, each decoding (one token a step) for a long while."""
    reqs = [Request(f"d{i}", [i + 1] * prompt_len, max_tokens=100_000) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    while any(r.num_output_tokens == 0 for r in reqs):
        step(sched)
    return reqs


def make_scheduler(cap: int, num_seqs: int = 128, budget: int = BUDGET) -> Scheduler:
    kv = KVCacheManager(num_blocks=(LONG + 64 * 1024) // 16, block_size=16)
    return Scheduler(kv, num_seqs, budget, max_model_len=LONG + 1024,
                     max_prefill_tokens_with_decodes=cap)


def test_a_long_prompt_beside_64_decodes_is_read_in_capped_chunks():
    sched = make_scheduler(CAP)
    decodes = running_decodes(sched, 64)
    long = Request("long", [3] * LONG, max_tokens=4)
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(sched)
        by_id = {c.request_id: c for c in out.chunks}
        # Every stream gets its token in every step ...
        assert all(by_id[d.request_id].num_tokens == 1 and by_id[d.request_id].sample
                   for d in decodes)
        # ... and the prompt a chunk of at most the cap.
        assert set(by_id) == {d.request_id for d in decodes} | {"long"}
        chunks.append(by_id["long"].num_tokens)
        assert out.num_batched_tokens == 64 + chunks[-1]
    assert len(chunks) == math.ceil(LONG / CAP)
    assert chunks[:-1] == [CAP] * (len(chunks) - 1) and sum(chunks) == LONG


def test_a_lone_long_prompt_gets_the_whole_budget():
    sched = make_scheduler(CAP)
    long = Request("long", [3] * LONG, max_tokens=4)
    sched.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        (chunk,) = step(sched).chunks
        chunks.append(chunk.num_tokens)
    assert chunks == [BUDGET] * math.ceil(LONG / BUDGET)


def test_the_cap_applies_from_the_step_a_decode_joins():
    """A short and a long prompt arrive together: the first step reads both with the whole
    budget; from the next the short one decodes, so the long one goes on in capped chunks
    and the stream gets its token in every step."""
    sched = make_scheduler(CAP)
    short = Request("short", [5] * 10, max_tokens=1000)
    long = Request("long", [3] * LONG, max_tokens=4)
    sched.add_request(short)
    sched.add_request(long)
    first = {c.request_id: c.num_tokens for c in step(sched).chunks}
    assert first == {"short": 10, "long": BUDGET - 10}
    sizes = []
    while long.num_output_tokens == 0:
        by_id = {c.request_id: c.num_tokens for c in step(sched).chunks}
        assert by_id["short"] == 1
        sizes.append(by_id["long"])
    assert sizes[:-1] == [CAP] * (len(sizes) - 1)
    assert len(sizes) == math.ceil((LONG - BUDGET + 10) / CAP)


def test_no_cap_lets_the_prompt_take_what_the_decodes_leave():
    sched = make_scheduler(0)
    decodes = running_decodes(sched, 64)
    long = Request("long", [3] * LONG, max_tokens=4)
    sched.add_request(long)
    out = step(sched)
    sizes = {c.request_id: c.num_tokens for c in out.chunks}
    assert sizes["long"] == BUDGET - len(decodes)
    assert all(sizes[d.request_id] == 1 for d in decodes)


def test_several_waiting_prompts_share_the_cap():
    sched = make_scheduler(CAP)
    running_decodes(sched, 4)
    for i in range(6):
        sched.add_request(Request(f"p{i}", [10 + i] * 200, max_tokens=4))
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        out = step(sched)
        prompt_tokens = sum(c.num_tokens for c in out.chunks
                                if c.request_id.startswith("p") and c.start < 200)
        assert 0 < prompt_tokens <= CAP  # bounded, and progress in every step
        assert sum(1 for c in out.chunks if c.request_id.startswith("d")) == 4


def test_the_default_cap_is_resolved_per_device():
    hf = SimpleNamespace(max_position_embeddings=4096)
    cfg = EngineConfig(model="m")
    assert cfg.max_prefill_tokens_with_decodes is None  # "the device's default"
    assert (cfg.resolve(hf, cuda_available=True).max_prefill_tokens_with_decodes
            == DEFAULT_PREFILL_TOKENS_WITH_DECODES["cuda"])
    assert (cfg.resolve(hf, cuda_available=False).max_prefill_tokens_with_decodes
            == DEFAULT_PREFILL_TOKENS_WITH_DECODES["cpu"])
    assert EngineConfig(model="m", max_prefill_tokens_with_decodes=0).resolve(
        hf, cuda_available=True).max_prefill_tokens_with_decodes == 0
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        EngineConfig(model="m", max_prefill_tokens_with_decodes=-1)
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        Scheduler(KVCacheManager(4, 4), 1, 8, 16, max_prefill_tokens_with_decodes=-5)
