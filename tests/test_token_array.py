"""A request's token ids are kept in arrays (pagedllm/core/token_array.py) wherever the
engine holds them for the request's lifetime, so Python's full garbage collections never
walk them id by id; what leaves the engine (RequestOutput) is still lists. References: the
same ids as plain lists, and the hashes and drafts computed from lists."""

from __future__ import annotations

import gc
from array import array

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import hash_block, root_hash
from pagedllm.core.ngram_proposer import find_ngram_draft
from pagedllm.core.request import Request
from pagedllm.core.token_array import as_token_array, token_array
from pagedllm.engine.llm_engine import LLMEngine


def _walked(ids) -> list:
    """What a garbage-collection pass visits from this object (a list: every item)."""
    return [o for o in gc.get_referents(ids) if not isinstance(o, type)]


def test_a_request_holds_arrays_whose_ids_the_collector_does_not_visit():
    prompt, out = [7, 300, 70000, 5, 5, 9], [11, 12, 13]
    req = Request("r", prompt, max_tokens=8, output_token_ids=list(out))
    assert len(_walked(list(prompt))) == len(prompt)  # what a list would cost a pass
    for ids in (req.prompt_token_ids, req.output_token_ids):
        assert isinstance(ids, array) and _walked(ids) == []
    assert isinstance(Request("e", prompt, max_tokens=1).output_token_ids, array)
    whole = prompt + out
    assert req.num_tokens == len(whole) and req.num_output_tokens == len(out)
    for i in range(len(whole)):
        assert req.token_at(i) == whole[i]
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert req.tokens(start, end).tolist() == whole[start:end], (start, end)


def test_as_token_array_keeps_an_array_and_copies_anything_else():
    a = token_array([1, 2, 3])
    assert as_token_array(a) is a
    wide = array("q", [1, 2, 3])
    assert as_token_array(wide) is not wide and as_token_array(wide).tolist() == [1, 2, 3]
    assert token_array(a) is not a  # a fresh copy even of an array
    with pytest.raises(OverflowError):
        token_array([2**31])  # never a silent wrap-around (ids are checked against the vocabulary first)


def test_block_hashes_and_ngram_drafts_do_not_depend_on_the_container():
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5]
    parent = root_hash(0)
    assert hash_block(parent, token_array(ids[:16])) == hash_block(parent, ids[:16])
    assert hash_block(parent, ids[:16]) != hash_block(parent, ids[1:17])
    for k in (1, 3):
        want = find_ngram_draft(ids, 1, 3, k)
        assert want  # "3 1 4 1 5" recurs: there is a draft to agree on
        assert find_ngram_draft(token_array(ids), 1, 3, k) == want


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    from hf_models import save_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-token-array"))
    save_tiny_model(path, "llama", vocab_size=256, max_position_embeddings=256)
    return path


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_running_engine_keeps_every_copy_of_the_ids_in_arrays_and_consistent(tiny_path, async_scheduling):
    engine = LLMEngine(EngineConfig(model=tiny_path, num_kv_blocks=64, max_model_len=128,
                                    skip_tokenizer_init=True, async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = {f"r{i}": [5 + i, 17, 42, 99, 200 + i] for i in range(3)}
    for rid, ids in prompts.items():
        engine.add_request(rid, None, ids, params)
    for _ in range(6):
        engine.step()
    core = engine.core
    states = core.executor.runner.states
    seen = 0
    for rid, req in core.scheduler.requests.items():
        worker = states[rid].token_ids
        front = engine.output_processor.parents[rid].seqs[0].token_ids
        for ids in (req.prompt_token_ids, req.output_token_ids, worker, front):
            assert isinstance(ids, array) and _walked(ids) == []
        assert req.prompt_token_ids.tolist() == prompts[rid]
        out = req.output_token_ids.tolist()
        assert out  # mid-run: some tokens are out
        # The worker's history is the prompt and then the outputs (it may know a token the
        # core has not read back yet); the front end has what the core has delivered.
        assert worker.tolist()[: len(prompts[rid]) + len(out)] == prompts[rid] + out
        assert front.tolist() == out[: len(front)]
        seen += 1
    assert seen == len(prompts)
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert sorted(finished) == sorted(prompts)
    for o in finished.values():
        assert type(o.prompt_token_ids) is list and type(o.outputs[0].token_ids) is list
        assert len(o.outputs[0].token_ids) == params.max_tokens
    engine.shutdown()
