"""Block manager and scheduler invariants under random workloads (no torch, no model).

A fake model samples random tokens; after every step we check: no block is owned twice
or leaked (ref counts equal table membership, free + owned = pool), the token budget and
the sequence cap hold, and in the end every request finishes and the pool is whole. With
`lookahead` each step is scheduled before the previous one's tokens come back, as async
scheduling does. The scheduler outputs are also replayed into the worker's `BlockTables`,
whose copy of every running request's table must equal the block manager's. With a prefill
cap, every step whose budget holds its decodes gives each of them its token, keeps the
prompt tokens within the cap while any decode runs, and moves a running prompt on.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.worker.block_table import BlockTables


def check_pool(kv: KVCacheManager) -> None:
    owners = Counter(b for table in kv.tables.values() for b in table)
    for b in range(kv.num_blocks):
        assert kv.ref_cnt[b] == owners.get(b, 0), f"block {b} ref count disagrees with tables"
        assert (kv.ref_cnt[b] == 0) == (b in kv.free_queue), f"block {b} free state wrong"
    for h, b in kv.cached.items():
        assert kv.block_hash[b] == h
    for table in kv.tables.values():
        assert len(table) == len(set(table)), "a request holds one block twice"


workload = st.fixed_dictionaries({
    "num_blocks": st.integers(8, 40),
    "block_size": st.sampled_from([1, 2, 4, 8]),
    "budget": st.integers(1, 64),
    "max_seqs": st.integers(1, 8),
    "caching": st.booleans(),
    "seed": st.integers(0, 2**16),
    "requests": st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(0, 3)),
                         min_size=1, max_size=12),
    "lookahead": st.booleans(),
    "prefill_cap": st.integers(0, 12),
})


@settings(max_examples=150, deadline=None)
@given(workload)
def test_scheduler_invariants(w):
    kv = KVCacheManager(w["num_blocks"], w["block_size"], w["caching"])
    max_len = 64
    sched = Scheduler(kv, w["max_seqs"], w["budget"], max_len, w["prefill_cap"])
    rng = random.Random(w["seed"])
    shared = [rng.randrange(50) for _ in range(30)]  # common prefix to exercise sharing
    reqs = []
    for i, (plen, max_tokens, prefix_kind) in enumerate(w["requests"]):
        prompt = (shared[:plen] if prefix_kind else []) + [rng.randrange(50) for _ in range(plen)]
        prompt = prompt[: max_len - 1]
        req = Request(f"r{i}", prompt, max_tokens, eos_token_ids=frozenset({0}))
        try:
            sched.add_request(req)
        except ValueError:
            assert min(len(prompt) + max_tokens, max_len) > kv.num_blocks * kv.block_size
            continue
        reqs.append(req)
    in_flight = None  # (scheduler output, sampled tokens) of the step not yet taken in
    worker = BlockTables(2, rows=2)  # small, so that rows and columns grow during the run
    for _ in range(5000):
        if not sched.has_unfinished() and in_flight is None:
            break
        # What each running request could compute now, and whether that is a decode. One
        # prompt is read at a time, behind every decode (so decodes come first in a step).
        reading = [i for i, r in enumerate(sched.running) if sched._prefilling(r)]
        assert reading in ([], [len(sched.running) - 1])
        decoding = {r.request_id: sched._to_compute(r) for r in sched.running
                    if not sched._prefilling(r)}
        prompts_running = any(sched._prefilling(r) and sched._to_compute(r)
                              for r in sched.running)
        out = sched.schedule()
        check_prefill_cap(out, decoding, prompts_running, w["budget"], w["prefill_cap"])
        assert out.num_batched_tokens <= w["budget"]
        assert sum(c.num_tokens for c in out.chunks) == out.num_batched_tokens
        assert len(sched.running) <= w["max_seqs"]
        assert len({c.request_id for c in out.chunks}) == len(out.chunks)
        worker.update(out.finished_req_ids, out.chunks)
        for req in sched.running:  # the worker's tables are the block manager's
            assert worker.block_ids(req.request_id) == kv.block_table(req.request_id)
        for c in out.chunks:
            req = sched.requests[c.request_id]
            # Every token of the chunk has a slot in the request's blocks.
            assert len(worker.block_ids(c.request_id)) * kv.block_size >= c.start + c.num_tokens
            # Nothing past the tokens sampled so far (known or in flight) is computed.
            assert c.start + c.num_tokens <= req.num_tokens + req.num_pending
            assert req.num_pending <= 2
            assert req.num_output_tokens + req.num_pending <= req.max_tokens
        check_pool(kv)
        if rng.random() < 0.05 and sched.running:  # occasional abort
            sched.abort(rng.choice(sched.running).request_id)
        sampled = {c.request_id: rng.randrange(50) for c in out.chunks if c.sample}
        if w["lookahead"]:
            if in_flight is not None:
                sched.update(*in_flight)
            in_flight = (out, sampled) if out.chunks else None
        else:
            sched.update(out, sampled)
        check_pool(kv)
    else:
        raise AssertionError("requests did not finish")
    assert all(r.is_finished for r in reqs)
    for r in reqs:
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert 1 <= r.num_output_tokens <= r.max_tokens
            assert r.num_tokens <= max_len
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.tables
    out = sched.schedule()  # delivers the last finished ids
    worker.update(out.finished_req_ids, out.chunks)
    assert len(worker) == 0 and not worker.num_blocks.any() and not worker.table.any()


def check_prefill_cap(out, decoding: dict[str, int], prompts_running: bool, budget: int,
                      cap: int) -> None:
    if out.num_preemptions:
        return  # a preempted decode gets no token: the pool ran dry
    sizes = {c.request_id: c.num_tokens for c in out.chunks}
    decode_tokens = sum(decoding.values())
    prompt_tokens = sum(n for rid, n in sizes.items() if rid not in decoding)
    if decode_tokens <= budget:
        assert all(sizes.get(rid) == n for rid, n in decoding.items() if n)
    if cap and decode_tokens:
        assert prompt_tokens <= cap
    if prompts_running and decode_tokens < budget:
        assert prompt_tokens > 0  # a prompt being read is never starved


def test_prefix_blocks_shared_and_refcounted():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = Request("a", list(range(10)), 4)
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    b = Request("b", list(range(8)) + [99, 98, 97], 4)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and hits == kv.block_table("a")[:2]
    assert kv.allocate_slots(b, 3, hits)
    assert [kv.ref_cnt[x] for x in hits] == [2, 2]
    kv.free(a)
    assert [kv.ref_cnt[x] for x in hits] == [1, 1]
    kv.free(b)
    # Freed but still cached: a third request hits without recomputing.
    c = Request("c", list(range(9)), 4)
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 8 and hits_c == hits


def test_fully_cached_prompt_still_computes_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", list(range(8)), 2)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_full_blocks(a)
    b = Request("b", list(range(8)), 2)
    _, n = kv.get_computed_blocks(b)
    assert n == 4  # the last block is recomputed so its final token yields logits


def test_eviction_is_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    reqs = []
    for i in range(2):
        r = Request(f"r{i}", [i * 10, i * 10 + 1, i * 10 + 2, i * 10 + 3], 1)
        kv.allocate_slots(r, 4)
        r.num_computed_tokens = 4
        kv.cache_full_blocks(r)
        reqs.append(r)
    kv.free(reqs[0])
    kv.free(reqs[1])
    assert len(kv.cached) == 4
    fresh = Request("x", [7, 7], 1)
    kv.allocate_slots(fresh, 2)
    # r0's tail block was freed first, so it is the one evicted.
    evicted = kv.block_table("x")[0]
    assert evicted == 1
    r0_again = Request("y", [0, 1, 2, 3, 5], 1)
    _, n = kv.get_computed_blocks(r0_again)
    assert n == 2


def test_request_that_can_never_fit_is_rejected():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    sched = Scheduler(kv, 4, 16, max_model_len=64)
    try:
        sched.add_request(Request("big", list(range(6)), 10))
    except ValueError as e:
        assert "pool" in str(e)
    else:
        raise AssertionError("expected a ValueError")
    try:
        sched.add_request(Request("long", list(range(64)), 1))
    except ValueError as e:
        assert "maximum context length" in str(e)
    else:
        raise AssertionError("expected a ValueError")
