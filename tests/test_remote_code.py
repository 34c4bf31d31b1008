"""Remote-code checkpoints (InternLM, InternLM2/3, Baichuan, Qwen v1, ChatGLM2/3) load from
their ORIGINAL layout without running their code, and generate exactly what the HF
reference they were converted from generates (greedy tokens equal, logprobs close); so do
transformers' own GLM / GLM-4 checkpoints."""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import remote_code_converters as converters
import torch
from hf_models import hf_greedy, random_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.models.remote_code import remote_code_config

MAX_NEW = 8


_reference = random_tiny_model


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _generate(path: str, prompts, max_new=MAX_NEW, **kw):
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, **kw)
    params = SamplingParams(temperature=0, max_tokens=max_new, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    res = []
    for o in outs:
        got = o.outputs[0]
        res.append((got.token_ids, [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids,
                                                                         strict=True)]))
    return res


def _check(path: str, hf_model, prompts, **kw):
    for p, (toks, lps) in zip(prompts, _generate(path, prompts, **kw), strict=True):
        ref_toks, ref_lps = hf_greedy(hf_model, p, MAX_NEW)
        assert toks == ref_toks
        assert lps == pytest.approx(ref_lps, abs=1e-4)


def test_internlm2_grouped_wqkv(tmp_path):
    hf = _reference("llama", num_attention_heads=8, num_key_value_heads=2)  # 4 q per kv group
    path = converters.to_internlm2(hf, str(tmp_path / "internlm2"))
    _check(path, hf, _prompts(4, seed=1), max_num_batched_tokens=16)


def test_internlm_v1_biases(tmp_path):
    hf = _reference("llama", num_key_value_heads=4, attention_bias=True)
    path = converters.to_internlm(hf, str(tmp_path / "internlm"))
    _check(path, hf, _prompts(3, seed=2))


def test_internlm3_head_dim_and_biases(tmp_path):
    """InternLM3: Llama names, an explicit head_dim wider than hidden/heads, GQA, and
    `qkv_bias` / `bias` on q/k/v, o_proj and the MLP."""
    hf = _reference("llama", head_dim=32, attention_bias=True, mlp_bias=True, rope_theta=50000.0)
    path = converters.to_internlm3(hf, str(tmp_path / "internlm3"))
    _check(path, hf, _prompts(3, seed=9), max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="qkv_bias=True but bias=False"):
        remote_code_config({**json.loads((tmp_path / "internlm3" / "config.json").read_text()),
                    "bias": False})


def test_baichuan_7b_w_pack(tmp_path):
    hf = _reference("llama", num_key_value_heads=4)
    path = converters.to_baichuan(hf, str(tmp_path / "baichuan"), "BaiChuanForCausalLM")
    _check(path, hf, _prompts(3, seed=3))


def test_baichuan2_norm_head(tmp_path):
    """Baichuan2 stores lm_head rows of any length and normalises them at inference: the
    reference holds unit rows, the checkpoint the same rows rescaled at random."""
    from safetensors.torch import load_file, save_file

    hf = _reference("llama", num_key_value_heads=4)
    with torch.no_grad():
        hf.lm_head.weight.copy_(torch.nn.functional.normalize(hf.lm_head.weight, dim=-1))
        hf.model.norm.weight.mul_(6.0)  # unit rows give small logits: keep greedy off ties
    path = converters.to_baichuan(hf, str(tmp_path / "baichuan2"), "BaichuanForCausalLM",
                          alibi=False, norm_head=True)
    tensors = load_file(f"{path}/model.safetensors")
    rows = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = rows * (0.5 + torch.rand(rows.shape[0], 1))
    save_file(tensors, f"{path}/model.safetensors")
    _check(path, hf, _prompts(3, seed=4))


def test_qwen_v1(tmp_path):
    hf = _reference("qwen2", num_key_value_heads=4, tie_word_embeddings=False)
    path = converters.to_qwen(hf, str(tmp_path / "qwen"))
    _check(path, hf, _prompts(3, seed=5), max_num_batched_tokens=16)


def test_chatglm_half_interleaved_rotary(tmp_path):
    hf = _reference("glm", head_dim=16, attention_bias=True, pad_token_id=0, eos_token_id=2,
                    rope_theta=50000.0)  # written as rope_ratio 5
    assert hf.config.rope_parameters.get("partial_rotary_factor") == 0.5
    path = converters.to_chatglm(hf, str(tmp_path / "chatglm"))
    _check(path, hf, _prompts(4, seed=6), max_num_batched_tokens=16)


@pytest.mark.parametrize("model_type", ["glm", "glm4"])
def test_transformers_glm(tmp_path, model_type):
    """transformers' own GlmForCausalLM / Glm4ForCausalLM checkpoints (save_pretrained):
    fused gate_up_proj, q/k/v bias without o bias, half-head interleaved rotary, and for
    Glm4 the norms after attention and MLP (given random weights, so each one counts)."""
    hf = _reference(model_type, head_dim=16, pad_token_id=0, eos_token_id=2, rope_theta=20000.0)
    assert hf.config.rope_parameters.get("partial_rotary_factor") == 0.5
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        {"glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM"}[model_type]]
    _check(str(tmp_path), hf, _prompts(4, seed=8), max_num_batched_tokens=16)


# ------------------------------------------------------------------ Mistral sliding window
def test_mistral_sliding_window_past_the_window(tiny_models, tmp_path):
    """Prompts and generations several windows long: each query sees only the last 8
    positions, as in transformers' Mistral. Chunked prefill (a small token budget) and cached
    prefixes (the second run) take the windowed paths of the prefill attention too."""
    path, hf = tiny_models("mistral", sliding_window=8)
    prompts = _prompts(4, seed=10, lo=12, hi=40)
    llm_kw = dict(max_num_batched_tokens=16, enable_prefix_caching=True)
    _check(path, hf, prompts, **llm_kw)
    _check(path, hf, [p[:20] + [7, 7] for p in prompts[:2]], **llm_kw)
    # the window matters for these prompts: full attention generates something else
    cfg = json.loads(open(f"{path}/config.json").read())
    cfg["sliding_window"] = None
    full = tmp_path / "full"
    full.mkdir()
    for f in os.listdir(path):
        if f != "config.json":
            shutil.copy(os.path.join(path, f), full / f)
    (full / "config.json").write_text(json.dumps(cfg))
    got = [t for t, _ in _generate(str(full), prompts)]
    assert got != [hf_greedy(hf, p, MAX_NEW)[0] for p in prompts]


def test_qwen2_sliding_window_layers(tiny_models):
    """Qwen2 with use_sliding_window: only the layers from max_window_layers on are windowed."""
    path, hf = tiny_models("qwen2", sliding_window=6, use_sliding_window=True, max_window_layers=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    _check(path, hf, _prompts(3, seed=12, lo=10, hi=30), max_num_batched_tokens=16)


def test_window_wider_than_the_context_keeps_it(tiny_models):
    """Mistral v0.2+ (`sliding_window: null`) and wide windows: the whole context."""
    for window in (None, 4096):
        path, _ = tiny_models("mistral", sliding_window=window)
        llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=16)
        assert llm.engine.max_model_len == 512


# ------------------------------------------------------------------ ALiBi (Baichuan-13B)
def _slopes_reference(n: int) -> list[float]:
    """The ALiBi paper's recursive construction, written independently of pagedllm's."""
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    p = 2 ** math.floor(math.log2(n))
    return pow2(p) + _slopes_reference(2 * p)[0::2][: n - p]


def _naive_alibi_logits(sd, cfg, ids: list[int]) -> torch.Tensor:
    """Full-sequence Baichuan-13B forward from the original tensors; adds m_h * j (key
    index) plus the causal mask, as the original modeling code does."""
    h, nh, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
    d = h // nh

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    n = len(ids)
    x = sd["model.embed_tokens.weight"][ids]
    slopes = torch.tensor(_slopes_reference(nh))
    bias = slopes[:, None, None] * torch.arange(n)[None, None, :].float()
    causal = torch.full((n, n), float("-inf")).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        y = rms(x, sd[f"{p}.input_layernorm.weight"])
        q, k, v = (y @ sd[f"{p}.self_attn.W_pack.weight"].T).split(h, dim=-1)
        q, k, v = (t.view(n, nh, d).transpose(0, 1) for t in (q, k, v))
        att = (q @ k.transpose(1, 2)) / math.sqrt(d) + bias + causal
        o = (att.softmax(-1) @ v).transpose(0, 1).reshape(n, h)
        x = x + o @ sd[f"{p}.self_attn.o_proj.weight"].T
        y = rms(x, sd[f"{p}.post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(y @ sd[f"{p}.mlp.gate_proj.weight"].T)
        x = x + (g * (y @ sd[f"{p}.mlp.up_proj.weight"].T)) @ sd[f"{p}.mlp.down_proj.weight"].T
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_alibi_slopes_match_paper():
    from pagedllm.model_executor.layers.rotary import alibi_slopes

    for n in (1, 4, 6, 8, 12, 40):
        assert alibi_slopes(n).tolist() == pytest.approx(_slopes_reference(n), rel=1e-6)


def test_baichuan_13b_alibi(tmp_path):
    cfg = {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan",
           "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                        "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
           "hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 6,
           "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6,
           "model_max_length": 256, "hidden_act": "silu", "torch_dtype": "float32",
           "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(0)
    h, inter, v = 48, 96, 256
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for i in range(2):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.self_attn.W_pack.weight": (3 * h, h), f"{p}.self_attn.o_proj.weight": (h, h),
                   f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                   f"{p}.mlp.down_proj.weight": (h, inter), f"{p}.input_layernorm.weight": (h,),
                   f"{p}.post_attention_layernorm.weight": (h,)}
    sd = {k: (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1
          else 0.2 * torch.randn(s, generator=g) for k, s in shapes.items()}
    path = tmp_path / "baichuan13b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file
    save_file(sd, str(path / "model.safetensors"))

    prompts = _prompts(4, seed=7, lo=5, hi=30)
    # chunked prefill and block-spanning decodes exercise every ALiBi path of the backend
    got = _generate(str(path), prompts, max_num_batched_tokens=8)
    for p, (toks, lps) in zip(prompts, got, strict=True):
        ids = list(p)
        for t, lp in zip(toks, lps, strict=True):
            ref = _naive_alibi_logits(sd, cfg, ids)[-1].log_softmax(-1)
            assert t == int(ref.argmax())
            assert lp == pytest.approx(ref[t].item(), abs=1e-4)
            ids.append(t)


# ------------------------------------------------------------------ config translation
def test_baichuan_variant_detection():
    base = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
            "num_hidden_layers": 32, "vocab_size": 64000}
    b1_7 = remote_code_config({**base, "architectures": ["BaiChuanForCausalLM"]})
    assert not b1_7.alibi and not b1_7.norm_head
    b2_7 = remote_code_config({**base, "architectures": ["BaichuanForCausalLM"], "vocab_size": 125696})
    assert not b2_7.alibi and b2_7.norm_head
    b2_13 = remote_code_config({**base, "architectures": ["BaichuanForCausalLM"], "hidden_size": 5120,
                        "num_attention_heads": 40, "vocab_size": 125696})
    assert b2_13.alibi and b2_13.norm_head and b2_13.max_position_embeddings == 4096


def test_published_configs_translate():
    """Key spellings of the published 7B configs (InternLM2 with dynamic NTK, Qwen-7B,
    ChatGLM3-6B) reach the decoder's shape."""
    from pagedllm.model_executor.models.llama import ModelShape

    internlm2 = remote_code_config({
        "architectures": ["InternLM2ForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 92544, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768, "rope_theta": 1000000,
        "rope_scaling": {"type": "dynamic", "factor": 2.0}, "bias": False,
        "torch_dtype": "bfloat16"})
    s = ModelShape(internlm2, "InternLM2ForCausalLM")
    assert (s.head_dim, s.num_kv_heads, s.qkv_bias, s.o_bias) == (128, 8, False, False)
    assert internlm2.rope_parameters["rope_type"] == "dynamic"
    assert internlm2.rope_parameters["rope_theta"] == 1e6
    qwen = remote_code_config({
        "architectures": ["QWenLMHeadModel"], "hidden_size": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 32, "kv_channels": 128, "intermediate_size": 22016,
        "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0,
        "seq_length": 8192, "vocab_size": 151936, "bf16": True, "no_bias": True})
    s = ModelShape(qwen, "QWenLMHeadModel")
    assert (s.intermediate, s.qkv_bias, s.o_bias, s.rotary_dim) == (11008, True, False, 128)
    assert str(qwen.dtype) == "torch.bfloat16" and qwen.max_position_embeddings == 8192
    glm = remote_code_config({
        "architectures": ["ChatGLMModel"], "num_layers": 28, "hidden_size": 4096,
        "num_attention_heads": 32, "kv_channels": 128, "multi_query_attention": True,
        "multi_query_group_num": 2, "ffn_hidden_size": 13696, "padded_vocab_size": 65024,
        "seq_length": 8192, "add_qkv_bias": True, "add_bias_linear": False, "rmsnorm": True,
        "layernorm_epsilon": 1e-5, "eos_token_id": 2})
    s = ModelShape(glm, "ChatGLMModel")
    assert (s.num_kv_heads, s.rotary_dim, s.rotary_interleaved, s.vocab) == (2, 64, True, 65024)
    with pytest.raises(ValueError, match="ChatGLM-6B v1"):
        remote_code_config({"architectures": ["ChatGLMModel"], "num_layers": 28, "hidden_size": 4096,
                    "num_attention_heads": 32, "inner_hidden_size": 16384, "vocab_size": 130528})
    with pytest.raises(ValueError, match="quantized"):
        remote_code_config({**{"architectures": ["QWenLMHeadModel"]}, "quantization_config": {"bits": 4}})


def test_dummy_weights_from_config_alone(tmp_path):
    """Benchmarks and `plan` build a remote-code architecture from config.json alone."""
    hf = _reference("glm", head_dim=16, attention_bias=True, pad_token_id=0, eos_token_id=2)
    converters.to_chatglm(hf, str(tmp_path))
    llm = LLM(model=str(tmp_path / "config.json"), load_format="dummy", skip_tokenizer_init=True,
              block_size=4, num_kv_blocks=32)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3,
                                                                         ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_unsupported_remote_code_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["FancyForCausalLM"], "model_type": "fancy",
         "auto_map": {"AutoConfig": "configuration_fancy.FancyConfig"}}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="supported:.*InternLM2ForCausalLM.*QWenLMHeadModel"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True)


# ------------------------------------------------------------------ Qwen v1 tokenizer
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"\xe4\xbd"]


def _write_rank_file(path, name: str, module: str, cls: str) -> int:
    """A tiny tiktoken rank file: the 256 bytes, then a few merges, plus a remote-code
    tokenizer_config.json. Returns the first special id."""
    import base64

    toks = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(toks)]
    (path / name).write_text("\n".join(lines) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": cls, "auto_map": {"AutoTokenizer": [f"{module}.{cls}", None]}}))
    return len(toks)


def _write_qwen_tokenizer(path) -> int:
    return _write_rank_file(path, "qwen.tiktoken", "tokenization_qwen", "QWenTokenizer")


def test_qwen_tokenizer(tmp_path):
    from pagedllm.tokenizers import load_family_tokenizer

    n = _write_qwen_tokenizer(tmp_path)
    tok = load_family_tokenizer(str(tmp_path))
    eot, im_start, im_end = n, n + 1, n + 2
    assert tok.eos_token_id == [eot, im_end]
    assert tok.convert_ids_to_tokens(n + 3) == "<|extra_0|>" and len(tok) == n + 208
    assert tok.encode("hello world") == [256 + 3, 256 + 8]
    assert tok.encode("2024") == [ord(c) for c in "2024"]  # digits one by one
    assert tok.encode("e\u0301") == tok.encode("\u00e9")  # NFC first
    for text in ("hello world", "naïve 你好\n\n  x", "tab\there 123"):
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("hi<|im_end|>\n<|endoftext|>")
    assert ids == [ord("h"), ord("i"), im_end, ord("\n"), eot]
    assert tok.decode(ids, skip_special_tokens=True) == "hi\n"
    assert tok.decode(ids) == "hi<|im_end|>\n<|endoftext|>"
    assert tok.decode([ord("a"), 100000]) == "a"  # padded embedding rows decode to nothing
    assert tok.decode(tok.encode("你")[:1]).endswith("\ufffd")  # incomplete UTF-8 shows

    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "hello"}],
                                  add_generation_prompt=True)
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    tail = tok.encode("assistant\n")
    assert ids[0] == im_start and ids[-len(tail) - 1:] == [im_start, *tail]
    assert ids[ids.index(im_end, 1) + 1:][:2] == [ord("\n"), im_start]


def test_glm4_tiktoken_tokenizer(tmp_path):
    from pagedllm.tokenizers import load_family_tokenizer

    n = _write_rank_file(tmp_path, "tokenizer.model", "tokenization_chatglm", "ChatGLM4Tokenizer")
    tok = load_family_tokenizer(str(tmp_path))
    gmask, sop, user, assistant = n + 2, n + 4, n + 7, n + 8
    assert tok.eos_token_id == [n, user, n + 9]
    assert tok.encode("hello world") == [gmask, sop, 256 + 3, 256 + 8]
    assert tok.decode(tok.encode("hello world"), skip_special_tokens=True) == "hello world"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                  add_generation_prompt=True)
    assert ids == [gmask, sop, user, ord("\n"), 256 + 3, assistant]


def test_qwen_v1_serves_chat_with_its_tokenizer(tmp_path):
    hf = _reference("qwen2", num_key_value_heads=4, tie_word_embeddings=False, vocab_size=512)
    path = tmp_path / "qwen"
    converters.to_qwen(hf, str(path))
    n = _write_qwen_tokenizer(path)
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64)
    assert {n, n + 2} <= set(llm.engine.eos_token_ids)
    out = llm.chat([{"role": "user", "content": "hello world"}],
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    prompt = out.prompt_token_ids
    assert prompt[0] == n + 1 and prompt.count(n + 2) == 2
    ref_toks, _ = hf_greedy(hf, prompt, 4)
    assert out.outputs[0].token_ids == ref_toks
    assert isinstance(out.outputs[0].text, str)


# ------------------------------------------------------------------ SentencePiece families
def _write_corpus(path, words: str, seed: int) -> None:
    """1500 lines of 12 words drawn from `words`: a training text for a tiny tokenizer."""
    rng = random.Random(seed)
    vocab = words.split()
    path.write_text("\n".join(" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(1500)))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A tiny byte-fallback SentencePiece model (identity normalisation, as Llama-family
    models ship), with <|im_start|>/<|im_end|> as user-defined pieces (as InternLM2)."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    _write_corpus(d / "corpus.txt", "the quick brown fox jumps over a lazy dog hello world 你好 世界 model zoo", 0)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=320, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2)
    return d / "sp.model"


def _sp_dir(tmp_path, sp_model, name: str, config: dict):
    import shutil

    d = tmp_path / name
    d.mkdir(exist_ok=True)
    shutil.copy(sp_model, d / "tokenizer.model")
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_sentencepiece_family_tokenizers(tmp_path, sp_model):
    from pagedllm.tokenizers import load_family_tokenizer

    baichuan = load_family_tokenizer(str(_sp_dir(tmp_path, sp_model, "baichuan", {
        "tokenizer_class": "BaichuanTokenizer", "add_bos_token": True, "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}})))
    assert baichuan.eos_token_id == 2 and baichuan.bos_token_id == 1
    for text in ("hello world", "the lazy 你好\n\nfox ÿ", " two  spaces"):
        ids = baichuan.encode(text)
        assert ids[0] == 1 and 0 not in ids  # BOS, and byte fallback leaves no <unk>
        assert baichuan.decode(ids, skip_special_tokens=True) == text
    partial = baichuan.encode("x\u00ff", add_special_tokens=False)[:-1]  # 1 of 2 fallback bytes
    assert baichuan.decode(partial).endswith("\ufffd")

    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    internlm2 = load_family_tokenizer(str(_sp_dir(tmp_path, sp_model, "internlm2", {
        "tokenizer_class": "InternLM2Tokenizer", "chat_template": chatml,
        "added_tokens_decoder": {"2": {"content": "</s>", "special": True}},
        "auto_map": {"AutoTokenizer": ["tokenization_internlm2.InternLM2Tokenizer", None]}})))
    im_start = internlm2.sp.piece_to_id("<|im_start|>")
    ids = internlm2.apply_chat_template([{"role": "user", "content": "hello"}],
                                        add_generation_prompt=True)
    assert ids.count(im_start) == 2 and ids[0] == im_start
    assert internlm2.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def _chatglm_llm(tmp_path, sp_model, name: str, tokenizer_config: dict):
    """A ChatGLM-layout checkpoint of a tiny Glm reference with a ChatGLM tokenizer."""
    hf = _reference("glm", head_dim=16, attention_bias=True, pad_token_id=0, eos_token_id=2,
                    vocab_size=352)
    converters.to_chatglm(hf, str(tmp_path / name))
    _sp_dir(tmp_path, sp_model, name, {
        "tokenizer_class": "ChatGLMTokenizer", **tokenizer_config,
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLMTokenizer", None]}})
    return hf, LLM(model=str(tmp_path / name), block_size=4, num_kv_blocks=64)


def test_chatglm_tokenizer_and_chat(tmp_path, sp_model):
    hf, llm = _chatglm_llm(tmp_path, sp_model, "chatglm", {"padding_side": "left"})
    tok = llm.engine.tokenizer
    n = tok.sp.get_piece_size()
    gmask, sop, user, assistant = n + 1, n + 3, n + 6, n + 7
    assert tok.encode("hello") == [gmask, sop, *tok.sp.encode("hello")]
    assert {2, user, n + 8} <= set(llm.engine.eos_token_ids)
    out = llm.chat([{"role": "user", "content": "hello"}],
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == [gmask, sop, user, *tok.sp.encode("\n hello"), assistant]
    ref_toks, _ = hf_greedy(hf, out.prompt_token_ids, 4)
    assert out.outputs[0].token_ids == ref_toks


def test_chatglm2_round_format(tmp_path, sp_model):
    """A checkpoint saved as chatglm2 (same files as ChatGLM3 otherwise) gets ChatGLM2's five
    command tokens, its "[Round n]" prompt format and only </s> as the end token."""
    from jinja2.exceptions import TemplateError

    hf, llm = _chatglm_llm(tmp_path, sp_model, "chatglm2-6b", {"name_or_path": "THUDM/chatglm2-6b"})
    tok = llm.engine.tokenizer
    n = tok.sp.get_piece_size()
    gmask, sop = n + 1, n + 3
    assert "<|user|>" not in tok.special_tokens and len(tok) == n + 5
    assert llm.engine.eos_token_ids == {2}
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the fox"},
            {"role": "user", "content": "你好"}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert text == "[gMASK]sop[Round 1]\n\n问：hello\n\n答：the fox\n\n[Round 2]\n\n问：你好\n\n答："
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == [gmask, sop, *tok.sp.encode(text[len("[gMASK]sop"):])]
    ref_toks, _ = hf_greedy(hf, out.prompt_token_ids, 4)
    assert out.outputs[0].token_ids == ref_toks
    with pytest.raises(TemplateError, match="no place for a system message"):
        tok.apply_chat_template([{"role": "system", "content": "x"}, *conv[:1]])


@pytest.fixture(scope="module")
def internlm_sp_model(tmp_path_factory):
    """A tiny SentencePiece model with InternLM (v1) chat's markers as user-defined pieces."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp_internlm")
    _write_corpus(d / "corpus.txt", "the quick brown fox jumps over a lazy dog hello world", 2)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=320, model_type="bpe",
        byte_fallback=True, character_coverage=1.0,
        user_defined_symbols=["<eoh>", "<eoa>", "<|User|>", "<|Bot|>", "<|System|>"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    return d / "sp.model"


def test_internlm_v1_chat_format(tmp_path, internlm_sp_model):
    """InternLM (v1) chat: BOS, "<|User|>:...<eoh>\n<|Bot|>:" per round; the markers are single
    tokens, and a reply stops at <eoa> as well as at </s>."""
    hf = _reference("llama", num_key_value_heads=4, attention_bias=True, vocab_size=352)
    path = tmp_path / "internlm"
    converters.to_internlm(hf, str(path))
    _sp_dir(tmp_path, internlm_sp_model, "internlm", {
        "tokenizer_class": "InternLMTokenizer", "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>",
        "auto_map": {"AutoTokenizer": ["tokenization_internlm.InternLMTokenizer", None]}})
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64)
    tok = llm.engine.tokenizer
    sp = tok.sp
    eoh, eoa, user, bot, system = (sp.piece_to_id(p) for p in ("<eoh>", "<eoa>", "<|User|>", "<|Bot|>",
                                                                 "<|System|>"))
    assert llm.engine.eos_token_ids == {2, eoa}
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "the fox"}, {"role": "user", "content": "a dog"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True)
    enc = sp.encode
    assert ids == [1, system, *enc(":be brief\n"), user, *enc(":hello"), eoh, *enc("\n"), bot,
                   *enc(":the fox"), eoa, *enc("\n"), user, *enc(":a dog"), eoh, *enc("\n"), bot, *enc(":")]
    assert tok.decode(ids, skip_special_tokens=True).count("hello") == 1
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    ref_toks, _ = hf_greedy(hf, ids, 4)
    assert out.outputs[0].token_ids == ref_toks


@pytest.fixture(scope="module")
def baichuan_sp_model(tmp_path_factory):
    """A tiny SentencePiece model laid out like Baichuan2's: reserved pieces after
    <unk> <s> </s>, so that ids 195 and 196 (its user / assistant tokens) are reserved."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp_baichuan")
    _write_corpus(d / "corpus.txt", "the quick brown fox jumps over a lazy dog hello world 你好 世界", 1)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "sp"), vocab_size=260, model_type="bpe",
        character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=[f"<reserved_{i}>" for i in range(200)], minloglevel=2)
    return d / "sp.model"


def _baichuan2_chat_dir(tmp_path, sp_model, vocab_size: int = 320):
    hf = _reference("llama", num_key_value_heads=4, vocab_size=vocab_size)
    path = tmp_path / "baichuan2"
    converters.to_baichuan(hf, str(path), "BaichuanForCausalLM", alibi=False, norm_head=False)
    _sp_dir(tmp_path, sp_model, "baichuan2", {
        "tokenizer_class": "BaichuanTokenizer", "add_bos_token": False, "bos_token": "<s>",
        "eos_token": "</s>",
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}})
    (path / "generation_config.json").write_text(json.dumps(
        {"user_token_id": 195, "assistant_token_id": 196, "eos_token_id": 2}))
    return hf, path


def test_baichuan_chat_format(tmp_path, baichuan_sp_model):
    """Each turn starts with its role token (ids from generation_config.json); the reply
    is prompted by the assistant token."""
    from pagedllm.tokenizers import load_family_tokenizer

    _, path = _baichuan2_chat_dir(tmp_path, baichuan_sp_model)
    tok = load_family_tokenizer(str(path))
    conv = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the fox"},
            {"role": "user", "content": "你好 world"}]
    ids = tok.apply_chat_template(conv, add_generation_prompt=True)
    sp = tok.sp
    assert ids == [195, *sp.encode("hello"), 196, *sp.encode("the fox"),
                   195, *sp.encode("你好 world"), 196]
    text = tok.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    assert text == f"{sp.id_to_piece(195)}hello{sp.id_to_piece(196)}"
    assert tok.decode(ids, skip_special_tokens=True).replace(" ", "") == "hellothefox你好world"
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="no place for a system message"):
        tok.apply_chat_template([{"role": "system", "content": "x"}, *conv[:1]])
    # without the role ids (Baichuan-7B) or with an ordinary piece there: no built-in format
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_family_tokenizer(str(path)).chat_template is None
    ordinary = next(i for i in range(sp.get_piece_size()) if sp.id_to_piece(i) == "▁fox")
    (path / "generation_config.json").write_text(json.dumps(
        {"user_token_id": ordinary, "assistant_token_id": 196}))
    tok = load_family_tokenizer(str(path))
    assert tok.chat_template is None and tok.encode("fox", add_special_tokens=False) == [ordinary]


def test_baichuan2_serves_chat(tmp_path, baichuan_sp_model):
    hf, path = _baichuan2_chat_dir(tmp_path, baichuan_sp_model)
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "hello world"}],
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    sp = llm.engine.tokenizer.sp
    assert out.prompt_token_ids == [195, *sp.encode("hello world"), 196]
    ref_toks, _ = hf_greedy(hf, out.prompt_token_ids, 4)
    assert out.outputs[0].token_ids == ref_toks
    assert isinstance(out.outputs[0].text, str)
