"""Engine processes freeze the heap they start with (pagedllm/heap.py), so that Python's
full garbage collections during a run walk only what the run made; PAGEDLLM_GC_FREEZE=0
leaves the heap alone. The suite itself runs with it off (conftest.py); these tests turn
it on and unfreeze after."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.heap import freeze_startup_heap


@pytest.fixture
def thawed():
    """Start from nothing frozen; leave nothing frozen (the suite drops its engines)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from hf_models import save_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-heap"))
    save_tiny_model(path, "llama", vocab_size=256, max_position_embeddings=256)
    return path


class _Node:
    pass


def test_live_objects_are_frozen_and_startup_garbage_is_collected_first(monkeypatch, thawed):
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "1")
    live = [_Node() for _ in range(500)]
    cycle = _Node()
    cycle.me = cycle  # garbage only a collection can free
    dead = weakref.ref(cycle)
    del cycle
    count = freeze_startup_heap("test")
    assert count == gc.get_freeze_count() and count >= len(live)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in live)  # out of the collector's passes
    assert dead() is None  # collected, not frozen for good


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_switch_leaves_the_heap_alone(monkeypatch, thawed, value):
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", value)
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0


def test_an_offline_engine_freezes_its_heap_and_generates_the_same(monkeypatch, thawed, tiny_path):
    prompts = [{"prompt_token_ids": [5 + i, 17, 42, 99]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "0")
    plain = LLM(tiny_path, num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True)
    assert gc.get_freeze_count() == 0
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "1")
    llm = LLM(tiny_path, num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True)
    assert gc.get_freeze_count() > 0
    engine_objects = {id(llm.engine), id(llm.engine.core), id(llm.engine.core.scheduler)}
    assert not engine_objects & {id(o) for o in gc.get_objects()}
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_a_front_end_freezes_its_heap(monkeypatch, thawed, tiny_path):
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "1")
    e = AsyncLLM(EngineConfig(model=tiny_path, num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True),
                 in_process=True)
    try:
        assert gc.get_freeze_count() > 0
        assert id(e.output_processor) not in {id(o) for o in gc.get_objects()}
    finally:
        e.shutdown()


def test_shutdown_thaws_the_heap_so_the_engine_can_be_collected(monkeypatch, thawed, tiny_path):
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "1")
    llm = LLM(tiny_path, num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True)
    llm.engine.cycle = llm.engine  # garbage only a collection frees once dropped
    gone = weakref.ref(llm.engine)
    assert gc.get_freeze_count() > 0
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert gone() is None


def test_a_dropped_engine_is_collected_before_the_next_one_starts(monkeypatch, thawed, tiny_path):
    """Dropped without a shutdown (a notebook rebinding `llm`): its frozen cycles would
    hold its KV pool for good; the next engine thaws and collects before it starts."""
    monkeypatch.setenv("PAGEDLLM_GC_FREEZE", "1")
    first = LLM(tiny_path, num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True)
    first.engine.cycle = first.engine
    gone = weakref.ref(first.engine)
    del first
    gc.collect()
    assert gone() is not None  # frozen: no collection reaches it
    second = LLM(tiny_path, num_kv_blocks=64, max_model_len=128, skip_tokenizer_init=True)
    assert gone() is None
    assert gc.get_freeze_count() > 0
    second.engine.shutdown()
