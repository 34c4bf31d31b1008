"""gpt-oss (GptOssForCausalLM) generates what transformers generates on a tiny random model:
attention sinks, alternating sliding (window 8 here) and full layers, YaRN, biased q/k/v/o,
the biased router and experts with the clamped SwiGLU; prompts longer than the window and
crossing blocks, under chunked prefill and prefix caching. An MXFP4 checkpoint in the
published layout loads as its dequantized twin (dequantized by transformers' own code)."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from hf_models import hf_greedy, random_tiny_model
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.layers.quantization import QuantConfig
from pagedllm.model_executor.models.gpt_oss import Mxfp4Experts, dequantize_mxfp4
from pagedllm.model_executor.models.moe import SparseMoeBlock

MAX_NEW = 6
WINDOW = 8
# Small swiglu_limit so that the clamps bite; YaRN stretched from 64 positions.
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
               sliding_window=WINDOW, swiglu_limit=1.5, max_position_embeddings=512,
               rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64,
                                "rope_theta": 150000.0})


def _reference(seed: int = 0):
    """A tiny random GptOss whose sinks and experts are large enough to matter."""
    model = random_tiny_model("gpt_oss", seed, **GPT_OSS)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("_bias") or name.endswith("router.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = _reference()
    hf.save_pretrained(path)
    return str(path), hf


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40, prefix: list[int] | None = None):
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(llm: LLM, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1, ignore_eos=True)
    out = []
    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
        got = o.outputs[0]
        out.append((got.token_ids, [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids, strict=True)]))
    return out


def _matches(results, hf, prompts, abs_tol=1e-4) -> bool:
    for p, (toks, lps) in zip(prompts, results, strict=True):
        ref_toks, ref_lps = hf_greedy(hf, p, MAX_NEW)
        if toks != ref_toks or lps != pytest.approx(ref_lps, abs=abs_tol):
            return False
    return True


def _model(llm: LLM):
    return llm.engine.executor.model


def test_gpt_oss_matches_transformers_chunked_and_cached(gpt_oss):
    path, hf = gpt_oss
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    # small blocks and a small token budget: prompts (up to 5x the window) cross blocks and
    # are read in chunks, decodes share steps with prefills
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=16, max_model_len=256)
    layers = _model(llm).model.layers
    assert [layer.self_attn.window for layer in layers] == [WINDOW, None]
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in layers)
    prompts = _prompts(4, seed=1, lo=3, hi=40)
    assert _matches(_run(llm, prompts), hf, prompts)
    # a shared prefix longer than the window, served from the prefix cache the second time
    shared = _prompts(3, seed=2, lo=4, hi=12, prefix=_prompts(1, seed=3, lo=30, hi=30)[0])
    first = _run(llm, shared)
    second = _run(llm, shared)
    assert llm.engine.scheduler.kv.prefix_hits >= 28
    assert _matches(second, hf, shared) and [t for t, _ in first] == [t for t, _ in second]


def test_batch_invariant_mode_matches_transformers(gpt_oss):
    """The batch-invariant attention (sinks from a row's start) and MoE, chunked."""
    path, hf = gpt_oss
    prompts = _prompts(3, seed=10, lo=10, hi=36)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, max_model_len=128,
              batch_invariant=True, max_num_batched_tokens=16)
    assert llm.engine.executor.model.model.layers[0].self_attn.backend.name == "batch_invariant"
    assert _matches(_run(llm, prompts), hf, prompts)


def test_sinks_clamp_and_window_matter(gpt_oss):
    """The checks see each gpt-oss feature: without it the same model fails them."""
    path, hf = gpt_oss
    prompts = _prompts(3, seed=4, lo=20, hi=36)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, max_model_len=128)
    assert _matches(_run(llm, prompts), hf, prompts)
    layers = _model(llm).model.layers
    sinks = [layer.self_attn.sinks.data.clone() for layer in layers]
    for layer in layers:
        layer.self_attn.sinks.data.fill_(float("-inf"))  # no sink: a plain softmax
    assert not _matches(_run(llm, prompts), hf, prompts)
    for layer, s in zip(layers, sinks, strict=True):
        layer.self_attn.sinks.data.copy_(s)
    layers[0].mlp.act.limit = 7.0
    assert not _matches(_run(llm, prompts), hf, prompts)
    layers[0].mlp.act.limit = GPT_OSS["swiglu_limit"]
    layers[0].self_attn.window = None
    assert not _matches(_run(llm, prompts), hf, prompts)


def test_tp2_equals_tp1(gpt_oss):
    """Two ranks (gloo on CPU): each its heads' sinks, its rows of every expert and their
    gate/up biases, the down bias added once (rank 0's) by the all-reduce."""
    path, hf = gpt_oss
    prompts = _prompts(3, seed=9, lo=10, hi=30)
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=64, block_size=4, max_model_len=128)
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        got = _run(llm, prompts)
    finally:
        llm.engine.shutdown()
    assert _matches(got, hf, prompts)


def test_bench_preset_has_gpt_oss_20b_shape():
    """The `gpu-oss-20b` workload's config builds gpt-oss-20b: 20.9B parameters as its model
    card counts them, alternating sliding and full layers, 256 x (256 in, 256 out)."""
    from transformers import AutoConfig

    from pagedllm.attention import TorchPagedAttention
    from pagedllm.entrypoints.bench_workloads import WORKLOADS
    from pagedllm.model_executor.models import resolve_architecture

    w = WORKLOADS["gpu-oss-20b"]
    assert (w.num_prompts, w.input_range, w.output_range, w.load_format) == (256, (256, 256), (256, 256), "dummy")
    cfg = AutoConfig.for_model("gpt_oss", **{k: v for k, v in w.arch_config.items() if k != "model_type"})
    arch, cls = resolve_architecture(cfg)
    with torch.device("meta"):
        model = cls(cfg, arch, 4096, TorchPagedAttention)
    assert 20.8e9 < sum(p.numel() for p in model.parameters()) < 21.0e9
    assert [layer.self_attn.window for layer in model.model.layers[:2]] == [128, None]
    # its MXFP4 experts kept packed, as on CUDA: about the published checkpoint's 13 GiB
    quant = QuantConfig.default(w.arch_config["quantization_config"]["quant_method"])
    with torch.device("meta"):
        packed = cls(cfg, arch, 4096, TorchPagedAttention, quant=quant)
    size = sum(p.numel() * (2 if p.is_floating_point() else 1) for p in packed.parameters())
    assert isinstance(packed.model.layers[0].mlp, Mxfp4Experts) and 12 * 2**30 < size < 14 * 2**30


def test_dummy_loader_fills_packed_experts(gpt_oss):
    """Random weights (load_format="dummy") for MXFP4 experts kept packed, as on CUDA:
    random codes at a small scale, zero biases, every other weight as for float models."""
    from pagedllm.attention import TorchPagedAttention
    from pagedllm.model_executor.loader.loader import _dummy_weights
    from pagedllm.model_executor.models.gpt_oss import GptOssForCausalLM

    _, hf = gpt_oss
    with torch.device("meta"):
        model = GptOssForCausalLM(hf.config, "GptOssForCausalLM", 64, TorchPagedAttention,
                                  quant=QuantConfig.default("mxfp4"))
    model = model.to_empty(device="cpu")
    _dummy_weights(model, seed=0)
    block = model.model.layers[0].mlp
    assert isinstance(block, Mxfp4Experts) and block.w13.dtype == torch.uint8
    assert len(block.w13.unique()) > 200 and block.w13_scale.eq(121).all() and block.b2.eq(0).all()
    w = dequantize_mxfp4(block.w2.view(*block.w2.shape[:2], -1, 16), block.w2_scale, torch.float32)
    assert 0.01 < w.std().item() < 0.06


def test_dequantize_mxfp4_equals_transformers():
    """Nibble order, the e2m1 table and the e8m0 bias, against transformers' dequantizer."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (3, 10, 4), dtype=torch.uint8, generator=g)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    assert torch.equal(ours, ref.transpose(1, 2))
    assert ours[0, 0, 0].item() == [0, .5, 1, 1.5, 2, 3, 4, 6][blocks[0, 0, 0, 0].item() & 7] * (
        -1 if blocks[0, 0, 0, 0].item() & 8 else 1) * 2.0 ** (scales[0, 0, 0].item() - 127)


def _mxfp4_pair(hf, tmp_path):
    """An MXFP4 checkpoint of `hf` with random packed experts, in the published layout,
    and its float twin (the experts dequantized by transformers), both on disk."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(5)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    packed, twin = {}, dict(state)
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, inp, out = state[name].shape
        blocks = torch.randint(0, 256, (e, out, inp // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(122, 127, (e, out, inp // 32), dtype=torch.uint8, generator=g)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        twin[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    quantized = {k: v for k, v in state.items() if k not in
                 {n.removesuffix("_blocks") for n in packed if n.endswith("_blocks")}}
    # the scales in one file and the blocks in another, as published shards can have them
    qdir, tdir = tmp_path / "mxfp4", tmp_path / "twin"
    for d in (qdir, tdir):
        hf.config.save_pretrained(d)
    save_file({**quantized, **{k: v for k, v in packed.items() if k.endswith("_scales")}},
              str(qdir / "model-00001-of-00002.safetensors"))
    save_file({k: v for k, v in packed.items() if k.endswith("_blocks")},
              str(qdir / "model-00002-of-00002.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (qdir / "config.json").write_text(json.dumps(cfg))
    save_file(twin, str(tdir / "model.safetensors"))
    return str(qdir), str(tdir), twin


def test_mxfp4_checkpoint_loads_as_its_dequantized_twin(gpt_oss, tmp_path):
    _, hf = gpt_oss
    qdir, tdir, twin = _mxfp4_pair(hf, tmp_path)
    kw = dict(skip_tokenizer_init=True, block_size=4, num_kv_blocks=128, max_model_len=128)
    quant, float_twin = LLM(model=qdir, **kw), LLM(model=tdir, **kw)
    for a, b in zip(_model(quant).model.layers, _model(float_twin).model.layers, strict=True):
        assert torch.equal(a.mlp.w13, b.mlp.w13) and torch.equal(a.mlp.w2, b.mlp.w2)
    prompts = _prompts(3, seed=6, lo=10, hi=30)
    got = _run(quant, prompts)
    assert got == _run(float_twin, prompts)
    twin_hf = copy.deepcopy(hf)  # transformers on the dequantized experts (the fixture's stays)
    twin_hf.load_state_dict(twin)
    assert _matches(got, twin_hf, prompts)


def test_harmony_reasoning_parser_splits_channels():
    from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser

    parser = get_reasoning_parser("gpt_oss")
    assert parser.keeps_special_tokens
    text = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
    whole = parser.parse(text, final=True)
    assert (whole.reasoning, whole.content) == ("The user greets; answer briefly.", "Hello there!")
    # every prefix parses to a prefix of the whole (what streaming relies on), and a
    # marker half written is never shown
    for cut in range(len(text)):
        part = parser.parse(text[:cut], final=False)
        assert whole.reasoning.startswith(part.reasoning or "")
        assert whole.content.startswith(part.content)
        assert "<|" not in (part.reasoning or "") + part.content
    # no harmony markup at all: plain content
    plain = parser.parse("Just text.", final=True)
    assert (plain.reasoning, plain.content) == (None, "Just text.")
    # a tool call is passed on (for a tool parser), its reasoning kept
    call = parser.parse("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
                        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
                        final=True)
    assert call.reasoning == "Need weather."
    assert call.content == ('<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>'
                            '{"city":"Paris"}<|call|>')


@pytest.mark.gpu
def test_cuda_gpt_oss_with_graphs_matches_eager_and_transformers(gpt_oss):
    """On CUDA: the Triton attention kernel with sinks, the fused MoE kernels with biases and
    the clamped SwiGLU, decode steps replayed from CUDA graphs; against the same engine run
    eagerly and against the CPU engine (float32), which the CPU tests hold to transformers."""
    path, _ = gpt_oss
    prompts = _prompts(5, seed=8, lo=3, hi=40)
    runs = []
    for eager in (False, True):
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda", block_size=16,
                  num_kv_blocks=256, enforce_eager=eager, max_num_seqs=8, max_model_len=256)
        assert (llm.engine.executor.runner.graphs is None) == eager
        runs.append(_run(llm, prompts))
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    _assert_same_run(runs[0], _cpu_run(path, prompts))


def _cpu_run(path: str, prompts):
    """The CPU engine's greedy run: the GPU tests' reference. transformers 5.17 (the GPU
    machine's) gives other logprobs for this tiny gpt-oss than the CPU engine and
    transformers 5.25 do (which agree to 1e-6), so the chain to transformers is kept by
    the CPU parity tests under CI's transformers rather than by the GPU machine's."""
    return _run(LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=16,
                    num_kv_blocks=256, max_num_seqs=8, max_model_len=256), prompts)


def _assert_same_run(got, want, abs_tol: float = 1e-3) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=abs_tol)


HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]


def _harmony_tokenizer():
    """A byte-level tokenizer whose harmony markers are special tokens, as in o200k_harmony."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(HARMONY_SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_harmony_answer_streamed_from_token_ids():
    """An answer decoded token by token with its special tokens kept (what the chat server
    asks for when the harmony reasoning parser is on), streamed through both harmony parsers:
    reasoning, content and the call come out; with special tokens skipped, the channels
    could not be told apart."""
    from pagedllm.entrypoints.openai.chat_output import OutputParser, StreamState
    from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
    from pagedllm.tokenizers.detokenizer import IncrementalDetokenizer

    tok = _harmony_tokenizer()
    answer = ("<|channel|>analysis<|message|>Weather needed: call the tool.<|end|><|start|>assistant"
              "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              '{"city": "Paris"}<|call|>')
    ids = tok.encode(answer, add_special_tokens=False)
    assert sum(i >= 256 for i in ids) == answer.count("<|")  # every marker one special token
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    state = StreamState(OutputParser(get_reasoning_parser("gpt_oss"), get_tool_parser("openai")))
    reasoning, content, args, name = "", "", "", None
    for n, i in enumerate(ids):
        detok.add(i)
        d = state.update(detok.text, final=n == len(ids) - 1).to_dict()
        reasoning += d.get("reasoning_content", "")
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            name = c["function"].get("name", name)
            args += c["function"]["arguments"]
    assert detok.text == answer
    assert (reasoning, content, name, json.loads(args)) == (
        "Weather needed: call the tool.", "", "get_weather", {"city": "Paris"})
    skipped = tok.decode(ids, skip_special_tokens=True)
    assert get_reasoning_parser("gpt_oss").parse(skipped, final=True).reasoning is None


@pytest.mark.gpu
def test_cuda_packed_mxfp4_matches_its_dequantized_twin(gpt_oss, tmp_path):
    """On CUDA the MXFP4 experts stay packed (the fused kernels dequantize them tile by
    tile): the same tokens as the float twin on CUDA, and tokens and logprobs as the CPU
    engine on the twin (which the CPU tests hold to transformers)."""
    _, hf = gpt_oss
    qdir, tdir, _ = _mxfp4_pair(hf, tmp_path)
    kw = dict(skip_tokenizer_init=True, dtype="float32", device="cuda", num_kv_blocks=256, max_model_len=256)
    quant = LLM(model=qdir, **kw)
    assert isinstance(_model(quant).model.layers[0].mlp, Mxfp4Experts)
    prompts = _prompts(4, seed=11, lo=10, hi=40)
    got, want = _run(quant, prompts), _run(LLM(model=tdir, **kw), prompts)
    assert [t for t, _ in got] == [t for t, _ in want]
    _assert_same_run(got, _cpu_run(tdir, prompts))
