"""Long contexts with rope scaling equal Hugging Face transformers at positions past 8k.

Tiny random models (hidden 64, 2 layers) read a prompt of 8,300 random tokens, chunked by
the token budget, and their greedy tokens and logprobs must equal HF `generate`'s. A
control model, the same weights with unscaled rope, answers differently, so the prompt is
long enough for the scaling to decide the tokens. Also: the context limit each scaling
gives (YaRN past max_position_embeddings, dynamic NTK up to it) and the prefill cap with
streams decoding beside the long prompt.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hf_models import hf_greedy, make_config

from pagedllm import LLM, SamplingParams
from pagedllm.config import model_max_positions

PROMPT_LEN = 8300
MAX_NEW = 6
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5],  # head_dim 16: 8 each
            "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0], "rope_theta": 10000.0}


def long_prompt(seed: int = 0, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def greedy(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW):
    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, [pos[t].logprob for pos, t in
                                      zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
            for o in outs]


def assert_equals_hf(got, hf_model, prompt, max_new: int = MAX_NEW) -> list[int]:
    tokens, lps = got
    ref_tokens, ref_lps = hf_greedy(hf_model, prompt, max_new)
    assert tokens == ref_tokens
    assert lps == pytest.approx(ref_lps, abs=1e-4)
    return ref_tokens


def unscaled_twin(hf_model, arch: str, **overrides):
    """The same weights with plain rope: what a model that ignored the scaling would say."""
    from transformers import AutoModelForCausalLM

    twin = AutoModelForCausalLM.from_config(make_config(arch, **overrides)).eval()
    twin.load_state_dict(hf_model.state_dict())
    return twin


def test_llama3_rope_past_8k_equals_hf_with_streams_beside_it(tiny_models):
    """Llama 3.1's scaling at 8,300 positions (past original_max_position_embeddings 8192),
    the prompt read in chunks of at most the prefill cap while two short prompts decode
    beside it; every sequence's tokens and logprobs equal HF's."""
    path, hf = tiny_models("llama", rope_scaling=LLAMA3, max_position_embeddings=16384)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=4,
              max_prefill_tokens_with_decodes=512)
    assert llm.engine.max_model_len == 16384  # max_position_embeddings
    shorts = [long_prompt(seed, 20) for seed in (1, 2)]
    long = long_prompt()
    outs = greedy(llm, [*shorts, long], max_new=MAX_NEW)
    for prompt, got in zip([*shorts, long], outs, strict=True):
        tokens = assert_equals_hf(got, hf, prompt)
    twin = unscaled_twin(hf, "llama", max_position_embeddings=16384, rope_theta=500000.0)
    assert hf_greedy(twin, long, MAX_NEW)[0] != tokens


@pytest.mark.parametrize("cap", [512, None])
def test_the_prompt_beside_streams_is_read_in_capped_chunks(tiny_models, cap):
    """The engine's own steps: with a stream decoding, the long prompt's chunks stay within
    the cap and the stream gets a token in every step. The offline class sets no cap
    unless asked (None): the prompt then takes the rest of the step's budget (2,048 on
    CPU)."""
    path, _ = tiny_models("llama", rope_scaling=LLAMA3, max_position_embeddings=16384)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=4,
              **({} if cap is None else {"max_prefill_tokens_with_decodes": cap}))
    engine = llm.engine
    assert engine.config.max_prefill_tokens_with_decodes == (cap or 0)
    want = cap or engine.config.max_num_batched_tokens - 1
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request("stream", None, long_prompt(3, 20), params)
    engine.step()  # the stream's prompt, then it decodes
    engine.add_request("long", None, long_prompt(), SamplingParams(temperature=0, max_tokens=1))
    stream, long = engine.scheduler.requests["stream"], engine.scheduler.requests["long"]
    chunks = []
    while not long.output_token_ids:
        before, computed = stream.num_output_tokens, long.num_computed_tokens
        engine.step()
        chunks.append(long.num_computed_tokens - computed)
        assert stream.num_output_tokens == before + 1
    assert max(chunks) == want and sum(chunks) == PROMPT_LEN
    assert len(chunks) == -(-PROMPT_LEN // want)


def test_yarn_serves_past_max_position_embeddings(tiny_models):
    """Qwen's way: max_position_embeddings stays at the pretrained 4096 and rope_scaling
    yarn (factor 4) extends it; the context limit is 4 x 4096 and the tokens at 8k equal
    HF's."""
    path, hf = tiny_models("qwen2", rope_scaling=YARN, max_position_embeddings=4096)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=2)
    assert llm.engine.max_model_len == 16384
    prompt = long_prompt()
    (got,) = greedy(llm, [prompt])
    tokens = assert_equals_hf(got, hf, prompt)
    twin = unscaled_twin(hf, "qwen2", max_position_embeddings=4096)
    assert hf_greedy(twin, prompt, MAX_NEW)[0] != tokens


def test_dynamic_ntk_is_exact_up_to_max_position_embeddings_and_refused_past_it(tiny_models):
    """transformers leaves dynamic NTK frequencies unscaled up to max_position_embeddings
    and recomputes them from the current length past it (new tokens only), which a cache of
    rotated keys cannot follow: the engine serves up to the limit, equal to HF there, and
    refuses a longer max_model_len saying why."""
    path, hf = tiny_models("llama", rope_scaling=DYNAMIC, max_position_embeddings=8448)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=2)
    assert llm.engine.max_model_len == 8448
    prompt = long_prompt()
    (got,) = greedy(llm, [prompt])
    assert_equals_hf(got, hf, prompt)
    with pytest.raises(ValueError, match="dynamic NTK"):
        LLM(model=path, skip_tokenizer_init=True, max_num_seqs=2, max_model_len=16384)


def test_longrope_factor_set_follows_max_model_len(tiny_models):
    """Phi-3's longrope: HF uses the long factors for a sequence past
    original_max_position_embeddings (4096), the short ones within it. The engine picks one
    set for all sequences from max_model_len: long past 4096 (a long prompt equals HF),
    short within it (a short prompt equals HF)."""
    path, hf = tiny_models("llama", rope_scaling=LONGROPE, max_position_embeddings=16384)
    prompt = long_prompt()
    (got,) = greedy(LLM(model=path, skip_tokenizer_init=True, max_num_seqs=2), [prompt])
    assert_equals_hf(got, hf, prompt)
    short = long_prompt(5, 300)
    (got,) = greedy(LLM(model=path, skip_tokenizer_init=True, max_num_seqs=2,
                        max_model_len=4096), [short])
    assert_equals_hf(got, hf, short)


@pytest.mark.parametrize(("config", "limit"), [
    ({"max_position_embeddings": 32768,  # Qwen2.5 with the yarn its card tells users to add
      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     131072),
    ({"max_position_embeddings": 163840,  # DeepSeek-V3: the extended length named already
      "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}},
     163840),
    ({"max_position_embeddings": 131072, "rope_scaling": LLAMA3}, 131072),
    ({"max_position_embeddings": 4096, "rope_scaling": DYNAMIC}, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": None}, 4096),
    ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                           "original_max_position_embeddings": 8192}},
     16384),
])
def test_model_max_positions(config, limit):
    assert model_max_positions(SimpleNamespace(**config)) == limit


@pytest.mark.gpu
def test_llama3_rope_past_32k_on_cuda_equals_hf(tiny_models):
    """The GPU path (Triton kernels, CUDA graphs for the decodes) with a 33,000-token
    prompt in float32: tokens and logprobs equal HF's at positions past 32k."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Four K/V heads (no GQA): the memory-efficient SDPA kernel HF is held to below takes
    # no enable_gqa (on the GPU machine it answered "No available kernel" with two).
    path, hf = tiny_models("llama", rope_scaling=LLAMA3, max_position_embeddings=65536, num_key_value_heads=4)
    # A pool of 34k tokens (not 90% of the card): HF runs beside it in the same process.
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=4, dtype="float32", device="cuda",
              block_size=16, num_kv_blocks=2200)
    prompt = long_prompt(5, 33000)
    (got,) = greedy(llm, [prompt])
    tokens, lps = got
    # HF's float32 prompt through the memory-efficient SDPA kernel: the math one would
    # materialise a 33k x 33k score matrix per head (16 GiB).
    with torch.device("cuda"), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        ref_tokens, ref_lps = hf_greedy(hf.to("cuda"), prompt, MAX_NEW)
    hf.to("cpu")
    assert tokens == ref_tokens
    assert lps == pytest.approx(ref_lps, abs=2e-3)


@pytest.mark.gpu
def test_the_pool_is_not_sized_down_by_the_profiles_pages(tiny_models):
    """The start-up profile gives its sequence a whole max_model_len of pages (here 128k
    tokens of 16 KiB: 2 GiB). Those pages are scaffolding: the real pool is what is left of
    gpu_memory_utilization after the weights and the step's activations, not after them."""
    import torch

    path, _ = tiny_models("llama", max_position_embeddings=131072, hidden_size=512, intermediate_size=1024,
                          num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    util = 0.5
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda", block_size=16,
              gpu_memory_utilization=util, enforce_eager=True)
    runner = llm.engine.executor.runner
    pool = llm.engine.num_kv_blocks * runner.bytes_per_block
    profile_pages = 131072 * runner.bytes_per_block // 16
    assert profile_pages == 2 * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    # weights (34 MB) and an 8,192-token step's activations are far below the 2 GiB
    left_out = total * util - before - pool
    assert 0 < left_out < profile_pages / 4
    llm.engine.shutdown()
