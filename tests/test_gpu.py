"""The same engine on CUDA: float32 equals HF exactly (greedy); bf16 follows HF until a
near-tie in the logits. Skipped without a GPU; run on the lent H200."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(n, seed, lo=5, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_run(model, prompt, max_new):
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(prompt):].tolist()
    return toks, [s[0].float().log_softmax(-1) for s in out.scores]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cuda_float32_parity(tiny_models, arch):
    path, hf = tiny_models(arch)
    hf = hf.to("cuda")
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda",
              block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
    prompts = _prompts(8, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == _hf_run(hf, p, 16)[0]
    hf.to("cpu")


def test_cuda_sliding_window(tiny_models):
    """Mistral's sliding window in the Triton kernel (decodes replayed from CUDA graphs,
    chunked prefills): prompts several windows long, greedy tokens equal to HF's."""
    path, hf = tiny_models("mistral", sliding_window=16)
    hf = hf.to("cuda")
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda",
              block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
    prompts = _prompts(6, seed=13, lo=20, hi=100)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == _hf_run(hf, p, 24)[0]
    hf.to("cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_bf16_follows_hf_until_near_tie(tiny_models, arch):
    path, hf32 = tiny_models(arch)
    import copy

    hf = copy.deepcopy(hf32).to("cuda", torch.bfloat16)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              block_size=16, num_kv_blocks=256)
    prompts = _prompts(8, seed=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        ref, ref_lps = _hf_run(hf, p, 24)
        got = o.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            if a != b:
                margin = (ref_lps[i][b] - ref_lps[i][a]).item()
                assert margin < 0.1, f"diverged at {i} with a clear margin {margin}"
                break


def test_cuda_graphs_match_eager(tiny_models):
    """Decode steps replayed from CUDA graphs (padded to captured sizes) give the tokens
    of the same engine run eagerly."""
    path, _ = tiny_models("qwen2")
    prompts = [{"prompt_token_ids": p} for p in _prompts(37, seed=13)]  # 37: padded to 48
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda",
                  num_kv_blocks=512, enforce_eager=eager, max_num_seqs=64)
        graphs = llm.engine.executor.runner.graphs
        assert (graphs is None) == eager
        if graphs is not None:  # the benchmarks' timing of replays: one pair of events a replay
            graphs.timing = []
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if graphs is not None:
            torch.cuda.synchronize()
            assert len(graphs.timing) == graphs.replays > 0
            assert all(a.elapsed_time(b) > 0 for a, b in graphs.timing)
    assert outs[0] == outs[1]


def test_cuda_async_scheduling_matches_in_step(tiny_models):
    """On CUDA the next step is launched (graph replay included) before the host has read
    the tokens it feeds on: greedy and seeded outputs, logprobs and preemptions as in step."""
    path, _ = tiny_models("qwen2")
    prompts = [{"prompt_token_ids": p} for p in _prompts(40, seed=17)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=9, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=9, ignore_eos=True)]
    plist = [params[i % 3] for i in range(len(prompts))]
    runs = []
    for asyn in (False, True):
        for blocks in (512, 48):  # 48 blocks of 16: preemptions
            llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda",
                      num_kv_blocks=blocks, async_scheduling=asyn, max_num_seqs=64)
            assert llm.engine.async_scheduling == asyn and llm.engine.executor.runner.graphs is not None
            outs = llm.generate(prompts, plist)
            runs.append([[(o.token_ids, [sorted(d) for d in (o.logprobs or [])]) for o in r.outputs]
                         for r in outs])
            assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
            if blocks == 48:
                assert llm.engine.scheduler.num_preemptions_total > 0
    assert runs[0] == runs[2] and runs[1] == runs[3]
