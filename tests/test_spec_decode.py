"""Speculative decoding with n-gram (prompt lookup) drafts: the outputs are the target
model's (greedy: the same tokens; sampling: the same distribution), only sooner.

The engine tests run a tiny random llama with chunked prefill (a small token budget),
prefix caching and small blocks, so that drafts cross block boundaries, get rejected and
are rolled back; the distribution test checks the rejection sampler itself, at
temperature 1 and with top-k, against the processed target probabilities."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineConfig, SpeculativeConfig
from pagedllm.core.ngram_proposer import NgramProposer, find_ngram_draft
from pagedllm.entrypoints.openai.cli_args import engine_config, make_arg_parser
from pagedllm.model_executor.layers.sampler import Sampler, SamplingBatch

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "max_batch_size": 8}


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"max_batch_size": -1}, "max_batch_size"),
    ({"lookahead": 2}, "lookahead"),
])
def test_a_wrong_configuration_names_its_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value({"method": "ngram", **bad})


@pytest.mark.parametrize("bad, field", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "model": "x"}, "speculative_config.model"),
    ({"model": ""}, "speculative_config.model"),
])
def test_a_draft_model_configuration_names_its_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_value(bad)


def test_a_model_means_method_draft_model():
    assert SpeculativeConfig.from_value({"model": "some/draft"}).method == "draft_model"
    assert SpeculativeConfig.from_value({}).method == "ngram"


def test_config_from_dict_json_and_flag(tiny_models):
    path, hf = tiny_models("llama")
    c = EngineConfig(model=path, speculative_config=SPEC)
    assert c.speculative_config == SpeculativeConfig(**SPEC)
    assert EngineConfig(model=path, speculative_config='{"num_speculative_tokens": 2}') \
        .speculative_config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="JSON"):
        EngineConfig(model=path, speculative_config="{nope")
    resolved = EngineConfig(model=path, speculative_config=SPEC, async_scheduling=True).resolve(hf.config, False)
    assert resolved.async_scheduling is True  # overlapped while the batch gate is closed
    default = EngineConfig(model=path, speculative_config={"method": "ngram"}).resolve(hf.config, False)
    assert default.speculative_config.max_batch_size == 4  # the CPU's: compute bound early
    args = make_arg_parser().parse_args(["--model", path, "--speculative-config",
                                         '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config(args).speculative_config.num_speculative_tokens == 5
    assert engine_config(make_arg_parser().parse_args(["--model", path])).speculative_config is None


# ---------------------------------------------------------------------- the proposer
def test_ngram_draft_follows_the_longest_earlier_suffix():
    #          0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 4, 5, 9, 2, 3, 7, 2, 3]
    # [2, 3] occurred at 6..7 (followed by 7) and 1..2 (by 4, 5): the most recent wins.
    assert find_ngram_draft(history, 1, 2, 3) == [7, 2, 3]
    # the longer [9, 2, 3]? absent; [1, 2, 3] at the start with max 3
    assert find_ngram_draft([1, 2, 3, 4, 8, 1, 2, 3], 1, 3, 2) == [4, 8]
    assert find_ngram_draft([5, 6, 7, 5, 6], 2, 2, 9) == [7, 5, 6]  # fewer where history ends
    assert find_ngram_draft([1, 2, 3], 1, 2, 2) == []  # nothing repeats
    assert find_ngram_draft([4, 4], 2, 3, 2) == []  # too short for min 2
    # a byte match straddling two ids (256 = 00 01 00 00, 1 = 01 00 00 00) is not a match
    assert find_ngram_draft([256, 0, 7, 1], 1, 1, 1) == []


def test_low_acceptance_stops_proposals_for_a_while():
    p = NgramProposer(2, 1, 2, max_batch_size=4, min_acceptance_rate=0.5)
    hist = [1, 2, 1]
    assert p.propose("a", hist, 2) == [2, 1]
    for _ in range(3):
        p.record("a", 2, 0)
    assert p.propose("a", hist, 2) == []  # rate fell below 0.5
    assert p.propose("b", hist, 2) == [2, 1]  # another request is unaffected
    assert p.enabled_for_batch(4) and not p.enabled_for_batch(5)


# ---------------------------------------------------------------------- the engine
def copy_prompt(seed: int, length: int = 12, times: int = 3) -> list[int]:
    rng = random.Random(seed)
    seq = [rng.randrange(1, 250) for _ in range(length)]
    return seq * times


PROMPTS = [
    {"prompt_token_ids": copy_prompt(0)},
    {"prompt_token_ids": copy_prompt(1, 20, 2) + [5, 6]},
    {"prompt_token_ids": [(7 * j) % 250 + 1 for j in range(13)]},  # ordinary
    {"prompt_token_ids": [(11 * j + 3) % 250 + 1 for j in range(40)]},  # ordinary, chunked
    {"prompt_token_ids": copy_prompt(0)[:20]},  # shares the first's prefix (cache hits)
]


def make(path: str, spec: dict | None) -> LLM:
    return LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
               max_num_batched_tokens=24, enable_prefix_caching=True, seed=0,
               speculative_config=spec)


@pytest.fixture(scope="module")
def pair(tiny_models):
    path, _ = tiny_models("llama")
    return make(path, None), make(path, SPEC)


def tokens(outs) -> list[list[list[int]]]:
    return [[list(o.token_ids) for o in r.outputs] for r in outs]


def assert_same_greedy(want, got) -> None:
    """The same tokens, and the same top logprobs at every position (within 1e-4)."""
    assert tokens(got) == tokens(want)
    for rw, rg in zip(want, got, strict=True):
        for a, b in zip(rw.outputs[0].logprobs, rg.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_greedy_outputs_equal_the_target_and_drafts_are_accepted(pair):
    base, spec = pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    want, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert_same_greedy(want, got)
    stats = spec.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert spec.engine.kv.num_free_blocks == spec.engine.kv.num_blocks  # every block back


def test_async_scheduling_overlaps_while_the_gate_is_closed(tiny_models):
    """Async scheduling stays on: a step that may carry drafts waits for the step before
    it, a verified step is read before the next is laid out, and steps of a batch too
    large for drafts overlap as without speculation. Same tokens as the plain engine."""
    path, _ = tiny_models("llama")
    base = make(path, None)
    spec = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
               max_num_batched_tokens=24, enable_prefix_caching=True, seed=0, async_scheduling=True,
               speculative_config={**SPEC, "max_batch_size": 2})
    assert spec.engine.async_scheduling
    core = spec.engine.core
    overlapped = []
    real_step = core.step

    def step():
        out = real_step()
        overlapped.append(core._inflight is not None)
        return out

    core.step = step
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True)]
    for prompts in (PROMPTS, [PROMPTS[1], PROMPTS[3]]):  # 5 decoding (no drafts), then 2
        for p in params:
            assert tokens(spec.generate(prompts, p)) == tokens(base.generate(prompts, p))
    stats = spec.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    assert any(overlapped) and not all(overlapped)


def test_again_with_a_warm_prefix_cache_and_n(pair):
    """The second run hits blocks the first cached: they must hold only accepted tokens."""
    base, spec = pair
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    assert tokens(spec.generate(PROMPTS, params)) == tokens(base.generate(PROMPTS, params))


def test_stop_token_ids_and_max_tokens_cut_inside_a_verified_chunk(pair):
    base, spec = pair
    free = base.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for r, prompt in zip(free, PROMPTS[:2], strict=True):
        toks = r.outputs[0].token_ids
        for stop_at in (3, 9, 17):
            p = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[toks[stop_at]])
            assert tokens(spec.generate([prompt], p)) == tokens(base.generate([prompt], p))
        for max_tokens in (1, 2, 5, 11):
            p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            (out,) = spec.generate([prompt], p)
            assert list(out.outputs[0].token_ids) == list(toks[:max_tokens])
            assert out.outputs[0].finish_reason == "length"


def test_sampled_requests_run_with_seeds_and_penalties_beside_drafts(pair):
    _, spec = pair
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True, logprobs=1)
              for s in range(3)] + [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True,
                                                   repetition_penalty=1.2, top_k=5)]
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]]
    a, b = spec.generate(prompts, params), spec.generate(prompts, params)
    assert tokens(a)[:3] == tokens(b)[:3]  # seeded: drawn from their own generators
    for r in a:
        o = r.outputs[0]
        assert len(o.token_ids) == len(o.logprobs or o.token_ids) and all(0 <= t < 256 for t in o.token_ids)


# ---------------------------------------------------------------------- the distribution
@pytest.mark.parametrize("top_k", [None, 6])
def test_rejection_sampling_keeps_the_target_distribution(top_k):
    """Many rows with the same logits and the same deterministic draft: the token each row
    emits (the draft if accepted, else a draw from the residual) must follow p."""
    torch.manual_seed(0)
    vocab, n = 12, 40000
    logits = torch.randn(vocab) * 1.5
    draft = int(logits.argsort(descending=True)[1])  # a likely but not the likeliest token
    b = SamplingBatch(temperature=torch.ones(n), generators=[None] * n, num_logprobs=[None] * n)
    if top_k:
        b.top_k = torch.full((n,), top_k, dtype=torch.long)
    out = Sampler(torch.Generator().manual_seed(1)).verify(
        logits.expand(n, vocab).clone(), b, torch.full((n,), draft, dtype=torch.long))
    p = logits.softmax(-1)
    if top_k:
        p = torch.where(logits >= logits.topk(top_k).values[-1], p, 0.0)
        p = p / p.sum()
    counts = torch.bincount(out.token_ids, minlength=vocab).double()
    assert counts[p == 0].sum() == 0
    expected = p.double() * n
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (chi2, dof)  # ~ p < 1e-4 would fail
    # about p(draft) of them took the draft
    assert abs(out.accepted.double().mean() - p[draft]) < 0.01


def test_greedy_verification_takes_drafts_up_to_the_first_mismatch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [9.0, 0.0, 0.0]])
    b = SamplingBatch(temperature=torch.zeros(4), generators=[None] * 4, num_logprobs=[None] * 4,
                      all_greedy=True)
    out = Sampler().verify(logits, b, torch.tensor([1, 0, 1, -1]))
    # row 0: argmax 1 == draft 1; row 1: argmax 0 == 0; row 2: argmax 2 != 1: emit 2
    assert out.accepted.tolist() == [True, True, False, False]
    assert out.token_ids.tolist()[:3] == [1, 0, 2]


# ---------------------------------------------------------------------- the core
def test_rejected_drafts_are_rolled_back_and_never_hashed():
    """Core alone: a chunk of 1 + 4 drafts crossing a block boundary, all rejected. The
    computed tokens end at the sampled one, the block held for the drafts goes back, and
    the next chunk sends a whole table; the blocks hashed are those of the real tokens."""
    from pagedllm.core.block_manager import KVCacheManager, hash_block
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=16, block_size=4)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                      proposer=NgramProposer(4, 1, 2))
    prompt = [1, 2, 3, 4, 5, 1, 2]
    sched.add_request(Request("a", prompt, max_tokens=20))
    out = sched.schedule()
    sched.update(out, {"a": 3})  # 8 tokens known, 7 computed; [2, 3] proposes 4, 5, 1, 2
    out = sched.schedule()
    (c,) = out.chunks
    assert c.start == 7 and c.num_tokens == 5 and c.draft_token_ids == [4, 5, 1, 2]
    assert len(kv.block_table("a")) == 3  # slots up to position 7 + 4 drafts
    sched.update(out, {"a": [8]})  # the first draft rejected: the target says 8
    req = sched.requests["a"]
    assert req.output_token_ids.tolist() == [3, 8] and req.num_computed_tokens == 8
    assert len(kv.block_table("a")) == 2 and sched.spec_num_accepted_tokens == 0
    real = prompt + [3, 8]
    chain, parent = set(), b"pagedllm-root"
    for i in range(len(real) // 4):
        parent = hash_block(parent, real[i * 4 : (i + 1) * 4])
        chain.add(parent)
    assert {kv.block_hash[b] for b in kv.block_table("a") if kv.block_hash[b]} <= chain
    out = sched.schedule()
    (c,) = out.chunks
    assert c.full_table and c.start == 8


# ---------------------------------------------------------------------- a real model
@pytest.fixture(scope="module")
def smol_spec():
    return LLM(max_model_len=2048, seed=0, kv_cache_memory="256MiB",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_min": 2})


def test_smollm_copies_with_drafts_and_stop_strings_cut_the_text(smol_llm, smol_spec):
    """SmolLM2 asked to repeat a sentence: most drafts are accepted, the text is the same
    as without speculation, and a stop string inside a verified chunk cuts it there."""
    tok = smol_llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Repeat the following text exactly: "
                                     "The quick brown fox jumps over the lazy dog near the river bank."}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = {"prompt_token_ids": list(tok.encode(text, add_special_tokens=False))}
    params = SamplingParams(temperature=0, max_tokens=30)
    before = smol_spec.engine.stats().spec_num_accepted_tokens
    (want,), (got,) = smol_llm.generate([prompt], params), smol_spec.generate([prompt], params)
    assert got.outputs[0].text == want.outputs[0].text
    assert smol_spec.engine.stats().spec_num_accepted_tokens - before >= 5
    words = want.outputs[0].text.split()
    stop = words[len(words) // 2]
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    (cut,) = smol_spec.generate([prompt], params)
    assert cut.outputs[0].text == smol_llm.generate([prompt], params)[0].outputs[0].text
    assert cut.outputs[0].finish_reason == "stop" and stop not in cut.outputs[0].text


def test_metrics_count_drafts_and_accepted_tokens():
    from pagedllm.engine.messages import SchedulerStats
    from pagedllm.metrics import EngineMetrics

    m = EngineMetrics("m")
    m.update_pool(SchedulerStats(0, 0, 0.0, 8, 8, 0, 0, 0, 3, 12, 7, [3, 2, 1, 1]))
    m.update_pool(SchedulerStats(0, 0, 0.0, 8, 8, 0, 0, 0, 4, 16, 9, [4, 3, 1, 1]))

    def value(name, **labels):
        return m.registry.get_sample_value(f"pagedllm:{name}_total", {"model_name": "m", **labels})

    assert value("spec_decode_num_draft_tokens") == 16
    assert value("spec_decode_num_accepted_tokens") == 9
    assert value("spec_decode_num_drafts") == 4
    assert value("spec_decode_num_accepted_tokens_per_pos", position="1") == 3


ROSTER = {"type": "array", "minItems": 4, "maxItems": 4,
          "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                     "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 99}},
                    "required": ["name", "age"]}}


def test_structured_outputs_with_ngram_drafts(smol_llm, smol_spec):
    """A JSON list repeats its keys, so n-gram drafts come up; each verified position is
    masked by the grammar after the drafts before it: the answer is valid and the same as
    without speculation (greedy and seeded)."""
    import json

    import jsonschema

    from pagedllm.sampling_params import StructuredOutputsParams as SO

    msgs = [{"role": "user", "content": "List four people with their ages as JSON."}]
    before = smol_spec.engine.stats().spec_num_accepted_tokens
    for params in (SamplingParams(temperature=0, max_tokens=80),
                   SamplingParams(temperature=0.7, seed=3, max_tokens=80)):
        params.structured_outputs = SO(json=ROSTER, disable_any_whitespace=True)
        (want,), (got,) = smol_llm.chat(msgs, params), smol_spec.chat(msgs, params)
        assert got.outputs[0].text == want.outputs[0].text
        jsonschema.validate(json.loads(got.outputs[0].text), ROSTER)
    assert smol_spec.engine.stats().spec_num_accepted_tokens - before >= 5
    assert smol_spec.engine.core._grammars is not None and len(smol_spec.engine.core._grammars) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("asyn", [False, True], ids=["sync", "async"])
def test_cuda_verify_steps_replay_their_graphs(tiny_models, asyn):
    """On CUDA: steps that verify drafts replay their own CUDA graphs (each sequence's rows
    right-aligned in k + 1, padding in front). Greedy tokens and logprobs equal the engine
    without speculation (float32); seeded sampling equals the eager speculative engine."""
    path, _ = tiny_models("llama")
    kw = dict(model=path, skip_tokenizer_init=True, block_size=16, num_kv_blocks=256,
              max_num_batched_tokens=64, enable_prefix_caching=True, seed=0, device="cuda", dtype="float32")
    base = LLM(**kw)
    spec = LLM(**kw, speculative_config=SPEC, async_scheduling=asyn)
    eager = LLM(**kw, speculative_config=SPEC, enforce_eager=True)
    graphs = spec.engine.executor.runner.verify_graphs
    assert graphs is not None and eager.engine.executor.runner.verify_graphs is None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    want, got = base.generate(PROMPTS, params), spec.generate(PROMPTS, params)
    assert_same_greedy(want, got)
    assert graphs.replays > 0 and spec.engine.stats().spec_num_accepted_tokens > 0
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in range(len(PROMPTS))]
    assert tokens(spec.generate(PROMPTS, seeded)) == tokens(eager.generate(PROMPTS, seeded))
