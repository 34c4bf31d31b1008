"""Block tables travel to workers as deltas (no torch, no model).

A request's table is sent once per admission (its first chunk, `full_table`), then each
chunk carries only the ids appended since the request's previous chunk. The worker's
`BlockTables` rebuilds the tables from those deltas; here it is checked against the block
manager through preemption, abort, prefix-cache hits and async-style lookahead, and a
decode step's message is shown not to grow with the context.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler, SchedulerOutput
from pagedllm.worker.block_table import BlockTables


def run_step(sched: Scheduler, worker: BlockTables, token: int = 7) -> SchedulerOutput:
    """Schedule, replay into the worker's tables (checked against the block manager's),
    and hand every sampled token back."""
    out = sched.schedule()
    worker.update(out.finished_req_ids, out.chunks)
    for c in out.chunks:
        assert worker.block_ids(c.request_id) == sched.kv.block_table(c.request_id)
    sched.update(out, {c.request_id: token for c in out.chunks if c.sample})
    return out


def test_decode_steps_carry_only_new_block_ids():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    sched.add_request(Request("a", list(range(10)), max_tokens=20))
    worker = BlockTables(8)
    first = run_step(sched, worker)
    (c,) = first.chunks
    assert c.full_table and c.new_block_ids == kv.block_table("a") and len(c.new_block_ids) == 3
    for _ in range(12):
        out = run_step(sched, worker)
        (c,) = out.chunks
        assert not c.full_table and not out.new_requests
        # Position c.start is written this step: a new block exactly when it starts one.
        assert c.new_block_ids == ([kv.block_table("a")[-1]] if c.start % 4 == 0 else [])


def decode_message_sizes(prompt_len: int) -> list[int]:
    """Pickled size (what each tensor-parallel rank receives) of decode steps of 32
    sequences, and that every chunk of those steps carries at most one block id."""
    kv = KVCacheManager(num_blocks=4096, block_size=16)
    sched = Scheduler(kv, max_num_seqs=32, max_num_batched_tokens=100_000, max_model_len=4096)
    for i in range(32):
        sched.add_request(Request(f"r{i}", [i] * prompt_len, max_tokens=100))
    worker = BlockTables(256)
    run_step(sched, worker)
    sizes = []
    for _ in range(8):
        out = run_step(sched, worker)
        assert len(out.chunks) == 32 and not out.new_requests
        assert all(c.num_tokens == 1 and not c.full_table and len(c.new_block_ids) <= 1 for c in out.chunks)
        if not any(c.new_block_ids for c in out.chunks):
            sizes.append(len(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    return sizes


def test_decode_message_size_does_not_grow_with_context():
    short, long = decode_message_sizes(20), decode_message_sizes(950)  # 2 vs 60 blocks each
    assert short and long
    # One more byte per sequence for positions past 255; 60 ids a sequence would be >120.
    assert max(long) - min(short) <= 32


def test_prefix_hits_are_part_of_the_first_table():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    worker = BlockTables(8)
    sched.add_request(Request("a", list(range(13)), max_tokens=1))
    a_blocks = run_step(sched, worker).chunks[0].new_block_ids  # a ends: its blocks stay cached
    sched.add_request(Request("b", list(range(12)) + [99, 98], max_tokens=2))
    out = run_step(sched, worker)
    assert out.finished_req_ids == ["a"] and "a" not in worker
    (c,) = out.chunks
    assert c.start == 12 and c.full_table and c.new_block_ids[:3] == a_blocks[:3]


def test_resumed_request_gets_a_full_table_and_keeps_its_row_until_then():
    """Two requests outgrow a pool of 4 blocks of 2: the newer is preempted (its blocks
    freed) and, once the other ends, admitted again with a full table of new blocks."""
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16)
    sched.add_request(Request("a", [1, 2, 3], max_tokens=4))
    sched.add_request(Request("b", [4, 5, 6], max_tokens=4))
    worker = BlockTables(2)
    seen_full: dict[str, int] = {"a": 0, "b": 0}
    preempted = False
    for _ in range(30):
        if not sched.has_unfinished():
            break
        out = run_step(sched, worker)
        preempted |= out.num_preemptions > 0
        for c in out.chunks:
            seen_full[c.request_id] += c.full_table
    assert preempted and seen_full == {"a": 1, "b": 2}
    out = sched.schedule()
    worker.update(out.finished_req_ids, out.chunks)
    assert len(worker) == 0


def test_block_tables_reuse_rows_grow_and_keep_zero_padding():
    bt = BlockTables(2, rows=1)
    bt.set("a", [5, 6])
    bt.set("b", [7])  # no free row: rows double
    bt.append("b", [8, 9, 10])  # past the width: columns grow
    assert bt.block_ids("a") == [5, 6] and bt.block_ids("b") == [7, 8, 9, 10]
    tables, counts = bt.gather(bt.rows(["b", "a"], 2))
    assert tables.tolist() == [[7, 8, 9, 10], [5, 6, 0, 0]] and counts.tolist() == [4, 2]
    tables[:] = -1  # a copy: the step's arrays never alias the kept tables
    assert bt.block_ids("b") == [7, 8, 9, 10]
    row_b = bt.row_of["b"]
    bt.remove("b")
    assert not bt.table[row_b].any()
    bt.set("c", [3])
    assert bt.row_of["c"] == row_b  # the freed row is reused
    bt.set("a", [4])  # a full table replaces the old one, padding included
    assert bt.table[bt.row_of["a"]].tolist() == [4, 0, 0, 0]
    assert bt.table.dtype == np.int32


workload = st.fixed_dictionaries({
    "num_blocks": st.integers(6, 30),
    "block_size": st.sampled_from([1, 2, 4]),
    "budget": st.integers(1, 40),
    "max_seqs": st.integers(1, 6),
    "caching": st.booleans(),
    "lookahead": st.booleans(),
    "seed": st.integers(0, 2**16),
    "num_requests": st.integers(1, 10),
})


@settings(max_examples=150, deadline=None)
@given(workload)
def test_worker_tables_follow_the_block_manager(w):
    """After every step the worker's table of each running request equals the block
    manager's, whatever preemption, aborts (of running and waiting requests), prefix hits
    and late arrivals do; in the end the worker holds nothing."""
    rng = random.Random(w["seed"])
    kv = KVCacheManager(w["num_blocks"], w["block_size"], w["caching"])
    sched = Scheduler(kv, w["max_seqs"], w["budget"], max_model_len=40)
    shared = [rng.randrange(20) for _ in range(24)]
    worker = BlockTables(1, rows=1)
    pending = [((shared[: rng.randrange(24)] + [rng.randrange(20) for _ in range(rng.randint(1, 8))])[:39],
                rng.randint(1, 12)) for _ in range(w["num_requests"])]
    released: list[str] = []
    in_flight = None
    for step in range(3000):
        if pending and rng.random() < 0.3:  # arrivals while others run: later ones hit the cache
            busy = {c.request_id for c in in_flight[0].chunks} if in_flight else set()
            free_ids = [r for r in released if r not in busy]  # as the engine allows
            rid = free_ids[0] if free_ids and rng.random() < 0.5 else f"s{step}"
            prompt, max_tokens = pending.pop()
            if rid in released:
                released.remove(rid)
            try:
                sched.add_request(Request(rid, prompt, max_tokens, eos_token_ids=frozenset({0})))
            except ValueError:  # larger than the whole pool
                pass
        if not pending and not sched.has_unfinished() and in_flight is None:
            break
        out = sched.schedule()
        for c in out.chunks:  # a delta only ever extends a table the worker holds
            assert c.full_table or c.request_id in worker
        worker.update(out.finished_req_ids, out.chunks)
        for req in sched.running:
            assert worker.block_ids(req.request_id) == kv.block_table(req.request_id)
        if rng.random() < 0.05 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        sampled = {c.request_id: rng.randrange(20) for c in out.chunks if c.sample}
        if w["lookahead"]:
            if in_flight is not None:
                sched.update(*in_flight)
            in_flight = (out, sampled) if out.chunks else None
        else:
            sched.update(out, sampled)
        for rid in [r for r, q in sched.requests.items() if q.is_finished]:
            sched.release(rid)
            released.append(rid)
    else:
        raise AssertionError("requests did not finish")
    out = sched.schedule()
    worker.update(out.finished_req_ids, out.chunks)
    assert len(worker) == 0 and not worker.table.any()
