"""Gemma 2, Gemma 3 and Phi-3/Phi-4 equal Hugging Face transformers on tiny random models:
greedy tokens and logprobs for batches of prompts longer than the sliding windows and
crossing block boundaries, under chunked prefill and prefix caching, and under tensor
parallelism (CPU, gloo).

What each checks: Gemma 2's soft-capped attention scores and final logits, its
local/global layers and query_pre_attn_scalar, the (1 + w) norms around attention and MLP,
the scaled embedding, gelu-tanh; Gemma 3's q/k norms and the local layers' own rope next to
a scaled global one; Gemma3ForConditionalGeneration's language model loaded from the
multimodal checkpoint (its vision tensors skipped); Phi-3's fused qkv_proj / gate_up_proj,
partial rotary and longrope (long factors past original_max_position_embeddings, short
within).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_models import hf_greedy, randomize
from test_hf_parity import _check, _prompts

from pagedllm import LLM, SamplingParams

IDS = dict(pad_token_id=0, bos_token_id=2, eos_token_id=1)  # inside the tiny vocabulary
GEMMA = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=3,
             tie_word_embeddings=False, norm_std=0.3, **IDS)
# local layers: theta 10k, unscaled; global: theta 1M, linear factor 4 (Gemma 3 4B+'s shape)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention"]
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                 "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]}

MODELS = {
    "gemma2": ("gemma2", dict(GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)),
    "gemma2-tied": ("gemma2", dict(GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                   tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(GEMMA, layer_types=LOCAL_GLOBAL, rope_parameters=GEMMA3_ROPE)),
    # Phi-3.5-mini / Phi-4: head 16, rotary on half of it, a sliding window on every layer
    "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5, sliding_window=12, **IDS)),
    # Phi-4-mini's shape: partial rotary 0.75 (12 of 16 dims, 6 factors) with longrope
    # (original_max_position_embeddings at the top level, as Phi-3 configs have it)
    "phi3-longrope": ("phi3", dict(partial_rotary_factor=0.75, rope_scaling=PHI3_LONGROPE,
                                   max_position_embeddings=256, original_max_position_embeddings=64,
                                   **IDS)),
}


def _model(tiny_models, name: str):
    model_type, overrides = MODELS[name]
    return tiny_models(model_type, **overrides)


@pytest.mark.parametrize("name", list(MODELS))
def test_batch_parity(tiny_models, name):
    """Mixed lengths (3..48 tokens, windows of 8 and 12, blocks of 4), decoded together;
    longrope's prompts run past its original 64 positions, where HF takes the long factors."""
    path, hf = _model(tiny_models, name)
    lo, hi = (66, 90) if name == "phi3-longrope" else (3, 48)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256)
    assert llm.engine.config.max_model_len > 64  # longrope: the long factors
    _check(llm, hf, _prompts(5, seed=11, lo=lo, hi=hi))


def test_batch_invariant_backend_soft_caps_too(tiny_models):
    """The batch-invariant mode's attention (its own backend) soft-caps as well."""
    path, hf = _model(tiny_models, "gemma2")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256, batch_invariant=True)
    assert llm.engine.executor.runner.backend.name == "batch_invariant"
    _check(llm, hf, _prompts(3, seed=18, lo=10, hi=40))


def test_softcaps_change_the_output(tiny_models):
    """The Gemma 2 model above depends on its caps: without them HF's logprobs differ
    (so the parity test sees them)."""
    path, hf = _model(tiny_models, "gemma2")
    prompt = _prompts(1, seed=12, lo=30, hi=30)[0]
    with torch.no_grad():
        capped = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        hf.config.attn_logit_softcapping = None
        hf.config.final_logit_softcapping = None
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        plain = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    hf.config.attn_logit_softcapping, hf.config.final_logit_softcapping = 3.0, 5.0
    for layer in hf.model.layers:
        layer.self_attn.attn_logit_softcapping = 3.0
    assert (capped - plain).abs().max() > 0.1


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3-partial"])
def test_parity_with_chunked_prefill_and_prefix_cache(tiny_models, name):
    """A 7-token budget splits the prompts into chunks (each chunk's queries see the
    cached earlier chunks through the window); then prompts sharing a 20-token prefix
    take its cached blocks and still equal HF."""
    path, hf = _model(tiny_models, name)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=7)
    engine = llm.engine
    chunked = []
    step = engine.executor.execute

    def spy(so):
        chunked.extend(c.num_tokens for c in so.chunks if c.num_tokens > 1 and not c.sample)
        return step(so)

    engine.executor.execute = spy
    shared = _prompts(1, seed=13, lo=20, hi=20)[0]
    prompts = [shared + tail for tail in _prompts(3, seed=14, lo=5, hi=15)]
    _check(llm, hf, prompts[:1])
    assert chunked, "a 7-token budget must split the prompt"
    _check(llm, hf, prompts[1:])
    again = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(temperature=0, max_tokens=1))
    assert again[0].num_cached_tokens >= 20


def test_longrope_short_factors_within_the_original_length(tiny_models):
    """max_model_len within original_max_position_embeddings: the short factors, as HF uses
    them for sequences that stay within it."""
    path, hf = _model(tiny_models, "phi3-longrope")
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, max_model_len=64)
    _check(llm, hf, _prompts(3, seed=15, lo=20, hi=50))


def _gemma3_multimodal(path: str):
    """A tiny Gemma3ForConditionalGeneration (SigLIP tower, projector, Gemma 3 language model),
    saved as transformers writes it: `language_model.model.*` beside `vision_tower.*`."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(3)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
                sliding_window=8, query_pre_attn_scalar=24, layer_types=LOCAL_GLOBAL,
                rope_parameters=GEMMA3_ROPE, **IDS)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=255, boi_token_index=253, eoi_token_index=254,
                          eos_token_id=[1, 106])
    model = randomize(Gemma3ForConditionalGeneration(config).float().eval(), norm_std=0.3)
    model.save_pretrained(path)
    return model


def test_gemma3_conditional_generation_serves_its_language_model(tmp_path):
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "mm")
    hf = _gemma3_multimodal(path)
    names = list(load_file(f"{path}/model.safetensors"))
    assert any(n.startswith("vision_tower.") for n in names)
    assert any(n.startswith("language_model.model.") for n in names)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256)
    assert llm.engine.hf_config.architectures == ["Gemma3ForConditionalGeneration"]
    assert llm.engine.eos_token_ids == {1, 106}  # the wrapper's own eos list
    prompts = _prompts(3, seed=16, lo=10, hi=40)
    _check(llm, hf, prompts)
    # transformers >= 4.52's in-memory naming (`model.language_model.*`) loads the same
    renamed = str(tmp_path / "mm-new-names")
    os.makedirs(renamed)
    for f in os.listdir(path):
        if f.endswith(".json"):
            with open(os.path.join(path, f)) as src, open(os.path.join(renamed, f), "w") as dst:
                dst.write(src.read())
    tensors = {(n.replace("language_model.model.", "model.language_model.", 1)
                if n.startswith("language_model.model.") else "model." + n): t
               for n, t in load_file(f"{path}/model.safetensors").items()}
    save_file(tensors, os.path.join(renamed, "model.safetensors"), metadata={"format": "pt"})
    _check(LLM(model=renamed, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256), hf, prompts[:1])


def test_generation_config_eos_list_stops_generation(tiny_models, tmp_path):
    """Gemma and Phi chat checkpoints list several end ids in generation_config.json
    (Gemma 3: [1, 106], `<end_of_turn>`); any of them ends a reply."""
    src, hf = _model(tiny_models, "gemma3")
    prompt = _prompts(1, seed=17, lo=25, hi=25)[0]
    tokens, _ = hf_greedy(hf, prompt, 8)
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    path = tmp_path / "with-eos-list"
    path.mkdir()
    for f in os.listdir(src):
        (path / f).write_bytes((open(os.path.join(src, f), "rb")).read())
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop_id]}))
    llm = LLM(model=str(path), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    assert {1, stop_id} <= set(llm.engine.eos_token_ids)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_soft_capping_is_refused_by_a_backend_without_it(tiny_models):
    from pagedllm.model_executor.models.llama import LlamaForCausalLM

    class NoCapBackend:
        name = "no-cap"

    _, hf = _model(tiny_models, "gemma2")
    with torch.device("meta"), pytest.raises(NotImplementedError, match="soft-capping"):
        LlamaForCausalLM(hf.config, "Gemma2ForCausalLM", 64, NoCapBackend)


def test_gemma2_tp2_greedy_equals_tp1(tiny_models):
    """Two ranks (gloo), each with one KV head and half the vocabulary of the tied head:
    soft-capping and the scaled embedding come after the all-reduce and the gather."""
    from test_tensor_parallel import _assert_tp2_equals_tp1

    path, _ = _model(tiny_models, "gemma2-tied")
    _assert_tp2_equals_tp1(path)


def test_phi3_fused_tensors_are_read_as_the_ranks_slice(tiny_models, monkeypatch):
    """Phi-3's fused qkv_proj / gate_up_proj cut into shards lazily: rank 1 of 2 reads its
    q, k, v heads and its gate and up rows from the file, not the whole fused tensor."""
    import functools

    import safetensors
    from safetensors.torch import load_file
    from test_tensor_parallel import _CountingSafeOpen, _load_as_rank

    from pagedllm.distributed import parallel_state

    reads: list = []
    monkeypatch.setattr(_CountingSafeOpen, "real", safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", functools.partial(_CountingSafeOpen, reads))
    monkeypatch.setattr(parallel_state, "_state", parallel_state._State(1, 2))
    path, _ = _model(tiny_models, "phi3-partial")
    model = _load_as_rank(path)
    fused = [(full, got) for name, full, got in reads if "qkv_proj" in name or "gate_up_proj" in name]
    assert fused and all(got[0] < full[0] for full, got in fused)
    full = load_file(f"{path}/model.safetensors")
    qkv = full["model.layers.1.self_attn.qkv_proj.weight"]  # [q 64 | k 32 | v 32] rows
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight,
                               torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]]))
    gate_up = full["model.layers.1.mlp.gate_up_proj.weight"]  # [gate 128 | up 128] rows
    torch.testing.assert_close(model.model.layers[1].mlp.gate_up_proj.weight,
                               torch.cat([gate_up[64:128], gate_up[192:256]]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_float32_parity_with_graphs(tiny_models, name):
    """On CUDA: the Triton kernel (soft-capping, windows), the fused Gemma norm and rotary,
    decodes replayed from CUDA graphs, chunked prefills; float32 equals HF."""
    from test_gpu import _hf_run

    path, hf = _model(tiny_models, name)
    hf = hf.to("cuda")
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda",
              block_size=16, num_kv_blocks=256, max_num_batched_tokens=64)
    assert llm.engine.executor.runner.graphs is not None
    lo, hi = (66, 120) if name == "phi3-longrope" else (5, 120)
    prompts = _prompts(8, seed=21, lo=lo, hi=hi)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1))
    for p, o in zip(prompts, outs, strict=True):
        ref, ref_lps = _hf_run(hf, p, 16)
        got = o.outputs[0]
        assert got.token_ids == ref
        lps = [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert lps == pytest.approx([r[t].item() for r, t in zip(ref_lps, ref, strict=True)], abs=1e-3)
    hf.to("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_cuda_bf16_follows_hf_until_near_tie(tiny_models, name):
    """bf16: Gemma's norms scale in float32 before rounding and the embedding scale is
    rounded to bf16 first, as in transformers; tokens agree until a near-tie."""
    import copy

    from test_gpu import _hf_run

    path, hf32 = _model(tiny_models, name)
    hf = copy.deepcopy(hf32).to("cuda", torch.bfloat16)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              block_size=16, num_kv_blocks=256)
    prompts = _prompts(8, seed=22, lo=5, hi=120)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        ref, ref_lps = _hf_run(hf, p, 24)
        for i, (a, b) in enumerate(zip(o.outputs[0].token_ids, ref, strict=True)):
            if a != b:
                margin = (ref_lps[i][b] - ref_lps[i][a]).item()
                assert margin < 0.1, f"diverged at {i} with a clear margin {margin}"
                break


def _word_tokenizer(path: str, chat_template: str | None = None) -> None:
    """A tiny word-level fast tokenizer saved to `path` (with Gemma's turn markers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "user", "model", "hi", "there"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", chat_template=chat_template)
    fast.save_pretrained(path)


GEMMA_TURNS = ("{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} {{ m['content'] }} "
               "<end_of_turn> {% endfor %}{% if add_generation_prompt %}<start_of_turn> model {% endif %}")


@pytest.mark.parametrize("where", ["tokenizer_config", "processor"])
def test_chat_template_comes_from_the_checkpoint(tmp_path, where):
    """The checkpoint's own template: the tokenizer's, or (multimodal Gemma 3) the
    processor's chat_template.json when the tokenizer has none."""
    from pagedllm.model_source import ModelSource
    from pagedllm.tokenizers import load_tokenizer

    _word_tokenizer(str(tmp_path), GEMMA_TURNS if where == "tokenizer_config" else None)
    if where == "processor":
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": GEMMA_TURNS}))
    tok = load_tokenizer(ModelSource(str(tmp_path), "hf", "safetensors"))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids) == "<bos> <start_of_turn> user hi there <end_of_turn> <start_of_turn> model"


def test_phi3_quantized_to_fp8_at_load(tiny_models):
    """quantization="fp8" on a Phi-3 float checkpoint: the fused tensors are cut into their
    shards as float rows, then each row quantized; on CPU the engine equals HF holding the
    quantize-dequantize of every decoder projection (one scale per output row, so the fused
    rows quantize as the split ones)."""
    from quant_packers import assert_parity, fake_quantize_fp8_rows, reference_model

    path, hf = _model(tiny_models, "phi3-partial")
    llm = LLM(model=path, quantization="fp8", skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    state = {n: fake_quantize_fp8_rows(t) if ".layers." in n and n.endswith("proj.weight") else t
             for n, t in hf.state_dict().items()}
    assert_parity(llm, reference_model(hf, state), _prompts(3, seed=19, lo=10, hi=30))


def test_gemma3_local_rope_from_either_transformers_spelling():
    """transformers 4.x names the local layers' base `rope_local_base_freq` beside a global
    `rope_theta` / `rope_scaling`; 5.x converts that into `rope_parameters` per layer type.
    Both give the local and global tables of transformers' own Gemma 3 rotary module."""
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from pagedllm.model_executor.layers.rotary import inv_freq_and_scale, per_layer_type_rope

    v5 = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=1e6,
                          rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    hf = Gemma3RotaryEmbedding(v5)
    v4 = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=None)  # unscaled global
    assert per_layer_type_rope(v5) and per_layer_type_rope(v4)
    for kind in ("sliding_attention", "full_attention"):
        inv, scale = inv_freq_and_scale(v5, 16, 128, kind)
        torch.testing.assert_close(inv, getattr(hf, f"{kind}_inv_freq"))
        assert scale == getattr(hf, f"{kind}_attention_scaling")
    torch.testing.assert_close(inv_freq_and_scale(v4, 16, 128, "sliding_attention")[0],
                               hf.sliding_attention_inv_freq)
    torch.testing.assert_close(inv_freq_and_scale(v4, 16, 128, "full_attention")[0] / 8,
                               hf.full_attention_inv_freq)
