"""Embeddings (pooling requests) against independent references: sentence-transformers
over a tiny random Qwen3 checkpoint with its pooling files, and the Hugging Face model's
own hidden states for the default (last token, normalized). Prompts longer than the step
budget are read in chunks, and pooling requests share steps with generation."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from hf_models import hf_greedy, save_tiny_model

from pagedllm import LLM
from pagedllm.config import default_model_path
from pagedllm.pooling_params import PoolerConfig, PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizers import gguf_tokenizer

ST_MODES = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token",
            "LAST": "pooling_mode_lasttoken", "MAX": "pooling_mode_max_tokens",
            "MEAN_SQRT_LEN": "pooling_mode_mean_sqrt_len_tokens"}
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog " * 3, "x",
         "paged attention keeps the cache in blocks of tokens, " * 2]
BUDGET = 16  # tokens a step reads: the longer texts take several chunks


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 checkpoint with the SmolLM2 tokenizer (no pooling files)."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3-embed"))
    tok = gguf_tokenizer(default_model_path())
    save_tiny_model(path, "qwen3", vocab_size=len(tok), max_position_embeddings=512)
    tok.save_pretrained(path)
    return path


def with_pooling(base: str, dest: str, pooling: str, normalize: bool) -> str:
    """The checkpoint plus sentence-transformers' modules.json and 1_Pooling/config.json."""
    shutil.copytree(base, dest)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(dest, "2_Normalize"))
    with open(os.path.join(dest, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(dest, "1_Pooling"))
    cfg = {"word_embedding_dimension": 64, **{m: False for m in ST_MODES.values()}}
    cfg[ST_MODES[pooling]] = True
    with open(os.path.join(dest, "1_Pooling", "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def make_llm(path: str, **kw) -> LLM:
    return LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=128,
               max_num_batched_tokens=BUDGET, max_model_len=256, **kw)


@pytest.mark.parametrize(("pooling", "normalize"),
                         [("MEAN", True), ("CLS", False), ("LAST", True), ("MEAN", False),
                          ("MAX", False), ("MEAN_SQRT_LEN", True)])
def test_matches_sentence_transformers(base_dir, tmp_path, pooling, normalize):
    st = pytest.importorskip("sentence_transformers")
    path = with_pooling(base_dir, str(tmp_path / "m"), pooling, normalize)
    ref_model = st.SentenceTransformer(path, device="cpu")
    # Text in, so the same tokenizer runs on both sides (a BOS-free tokenizer here).
    ref = ref_model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    llm = make_llm(path)
    assert llm.engine.processor.pooler_config.pooling_type == pooling
    outs = llm.embed(TEXTS)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)


def test_dense_modules_match_sentence_transformers(base_dir, tmp_path):
    """sentence-transformers' Dense modules after the pooling (64 -> 48 tanh, 48 -> 32 no
    bias), then Normalize, saved by sentence-transformers itself: the same vectors, 32 wide,
    with prompts read in chunks (max pooling across them)."""
    st = pytest.importorskip("sentence_transformers")
    path = with_pooling(base_dir, str(tmp_path / "m"), "MAX", False)
    base = st.SentenceTransformer(path, device="cpu")
    torch.manual_seed(0)
    dense = [st.models.Dense(64, 48, activation_function=torch.nn.Tanh()),
             st.models.Dense(48, 32, bias=False, activation_function=torch.nn.Identity())]
    ref_model = st.SentenceTransformer(modules=[*base, *dense, st.models.Normalize()], device="cpu")
    saved = str(tmp_path / "dense")
    ref_model.save(saved)
    ref = ref_model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    llm = make_llm(saved)
    assert llm.engine.processor.pooler_config.hidden_size == 32
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    assert got.shape == ref.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    undensed = np.array([o.outputs.embedding for o in make_llm(path).embed(TEXTS)])
    assert undensed.shape == (len(TEXTS), 64)  # the Dense layers did the narrowing


def hf_last_token(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(h, dim=-1).numpy()


def test_default_is_last_token_normalized_and_shares_steps_with_generation(tmp_path):
    """No pooling files: the last token's final hidden state, L2-normalized (compared
    with HF's hidden states); embeddings and generations in the same steps leave the
    generated tokens as HF's greedy ones."""
    path = str(tmp_path / "plain")
    model = save_tiny_model(path, "qwen3", vocab_size=256)
    llm = make_llm(path, skip_tokenizer_init=True)
    assert PoolerConfig.from_model(path, model.config) == PoolerConfig(hidden_size=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 23, 40, 1)]
    eng = llm.engine
    eng.add_request("g0", None, prompts[1], SamplingParams(temperature=0, max_tokens=12))
    for i, ids in enumerate(prompts):
        eng.add_pooling_request(f"e{i}", None, ids)
    eng.add_request("g1", None, prompts[2], SamplingParams(temperature=0, max_tokens=12))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    for i, ids in enumerate(prompts):
        out = done[f"e{i}"]
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(out.outputs.embedding, hf_last_token(model, ids),
                                   rtol=1e-4, atol=1e-5)
    for rid, ids in (("g0", prompts[1]), ("g1", prompts[2])):
        assert done[rid].outputs[0].token_ids == hf_greedy(model, ids, 12)[0]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # every page back in the pool
    # Batched equals one by one, and a prefix-cache hit (the same prompt again) changes nothing.
    batched = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts])]
    for p, b in zip(prompts, batched, strict=True):
        np.testing.assert_allclose(llm.embed({"prompt_token_ids": p})[0].outputs.embedding, b,
                                   rtol=1e-5, atol=1e-6)


def test_mean_pooling_survives_preemption(base_dir, tmp_path):
    """A generation that grows while an embedding reads its prompt slowly (4 tokens a
    step beside decodes) runs the pool dry: the embedding, the newest, is preempted
    mid-prompt and read again later; its mean must start over, not count twice."""
    st = pytest.importorskip("sentence_transformers")
    path = with_pooling(base_dir, str(tmp_path / "mean"), "MEAN", True)
    text = TEXTS[3] * 2
    ref = st.SentenceTransformer(path, device="cpu").encode([text], convert_to_numpy=True)[0]
    llm = LLM(model=path, dtype="float32", block_size=4, num_kv_blocks=16,
              max_num_batched_tokens=BUDGET, max_prefill_tokens_with_decodes=4, max_model_len=96)
    eng = llm.engine
    assert 40 < len(eng.encode(text)) <= 64
    preempted: list[str] = []
    real_preempt = eng.scheduler._preempt

    def spy(req, *args):
        preempted.append(req.request_id)
        real_preempt(req, *args)

    eng.scheduler._preempt = spy
    eng.add_request("g", None, [5] * 8, SamplingParams(temperature=0, max_tokens=50,
                                                       ignore_eos=True))
    eng.step()
    eng.add_pooling_request("e", text, None)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert "e" in preempted
    np.testing.assert_allclose(done["e"].outputs.embedding, ref, rtol=1e-4, atol=1e-5)


def test_limits_and_truncation(tmp_path):
    path = str(tmp_path / "plain")
    save_tiny_model(path, "qwen3", vocab_size=256)
    llm = make_llm(path, skip_tokenizer_init=True)
    whole = [i % 255 + 1 for i in range(256)]  # the full context: nothing is generated
    assert len(llm.embed({"prompt_token_ids": whole})[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed({"prompt_token_ids": whole + [1]})
    with pytest.raises(ValueError, match="at least one token"):
        llm.embed({"prompt_token_ids": []})
    cut = llm.embed({"prompt_token_ids": [7] * 10 + whole}, truncate_prompt_tokens=-1)[0]
    assert cut.prompt_token_ids == whole
    last = llm.embed({"prompt_token_ids": whole[-5:]})[0].outputs.embedding
    np.testing.assert_allclose(
        llm.embed({"prompt_token_ids": whole}, truncate_prompt_tokens=5)[0].outputs.embedding,
        last, rtol=1e-5, atol=1e-6)
    # Matryoshka truncation is refused unless the model declares it; a request's own
    # PoolingParams cut and renormalize.
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.engine.processor.pooler_config.params(dimensions=8)
    short = llm.embed({"prompt_token_ids": whole[:9]},
                      pooling_params=PoolingParams("LAST", True, 8))[0].outputs.embedding
    full = llm.embed({"prompt_token_ids": whole[:9]},
                     pooling_params=PoolingParams("LAST", False))[0].outputs.embedding
    np.testing.assert_allclose(short, np.array(full[:8]) / np.linalg.norm(full[:8]), rtol=1e-5)


def test_prompts_fed_in_batches_equal_all_at_once(base_dir, monkeypatch):
    """embed() tokenizes and queues a few prompts at a time while earlier ones run: the
    vectors and their order are those of one up-front batch, texts and token ids mixed;
    a bad prompt in a later batch fails the call and leaves nothing running."""
    llm = make_llm(base_dir)
    prompts = [TEXTS[i % len(TEXTS)] + f" {i}" for i in range(11)]
    prompts[4] = {"prompt_token_ids": [5, 6, 7, 8]}
    want = [o.outputs.embedding for o in llm.embed(prompts)]
    monkeypatch.setattr(LLM, "EMBED_FEED", 3)
    outs = llm.embed(prompts)
    assert [o.prompt_token_ids for o in outs][4] == [5, 6, 7, 8]
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in outs]), np.array(want),
                               rtol=1e-5, atol=1e-6)
    bad = prompts[:7] + [{"prompt_token_ids": [1] * 300}] + prompts[7:]
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed(bad)
    assert not llm.engine.has_unfinished_requests()
    np.testing.assert_allclose(llm.embed(prompts[:2])[1].outputs.embedding, want[1], rtol=1e-5, atol=1e-6)


def test_base_model_checkpoint(tmp_path):
    """An embedding checkpoint saved as a bare base model (Qwen3Model: no `model.` prefix,
    no lm_head), as sentence-transformers saves decoder embedding models."""
    from hf_models import make_config
    from transformers import AutoModel

    torch.manual_seed(0)
    base = AutoModel.from_config(make_config("qwen3", tie_word_embeddings=False),
                                 torch_dtype=torch.float32).eval()
    path = str(tmp_path / "base")
    base.save_pretrained(path)
    assert base.config.architectures == ["Qwen3Model"]
    llm = make_llm(path, skip_tokenizer_init=True)
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    with torch.no_grad():
        ref = torch.nn.functional.normalize(base(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
    got = llm.embed({"prompt_token_ids": ids})[0].outputs.embedding
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["MEAN", "LAST"])
def test_gpu_matches_sentence_transformers(base_dir, tmp_path, pooling):
    """On CUDA (Triton attention, async scheduling, decode graphs for the generation beside
    them): chunked embeddings equal sentence-transformers' on the same checkpoint."""
    st = pytest.importorskip("sentence_transformers")
    path = with_pooling(base_dir, str(tmp_path / "gpu"), pooling, True)
    ref = st.SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(model=path, dtype="float32", device="cuda", block_size=16, num_kv_blocks=128,
              max_num_batched_tokens=BUDGET, max_model_len=256)
    assert llm.engine.async_scheduling
    eng = llm.engine
    eng.add_request("g", None, [5] * 8, SamplingParams(temperature=0, max_tokens=30,
                                                       ignore_eos=True))
    eng.step()
    for i, text in enumerate(TEXTS):
        eng.add_pooling_request(f"e{i}", text, None)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    got = np.array([done[f"e{i}"].outputs.embedding for i in range(len(TEXTS))])
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-4)
    assert len(done["g"].outputs[0].token_ids) == 30


def test_runner_pooling_serves_embeddings_only(tmp_path):
    """`runner="pooling"` (vLLM's older `task="embed"`): embed works, generation is refused
    offline and on the server's generation routes."""
    import argparse

    from fastapi.testclient import TestClient
    from test_server import _RecordingEngine

    from pagedllm.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.cli_args import engine_config, make_arg_parser, parse_args

    assert EngineConfig.from_kwargs(task="embed").runner == "pooling"
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(runner="embed")
    parser = make_arg_parser(argparse.ArgumentParser())
    assert engine_config(parse_args(parser, ["--task", "embed"])).runner == "pooling"
    assert engine_config(parse_args(parser, ["--runner", "pooling"])).runner == "pooling"
    path = str(tmp_path / "plain")
    save_tiny_model(path, "qwen3", vocab_size=256)
    llm = make_llm(path, skip_tokenizer_init=True, task="embed")
    assert len(llm.embed({"prompt_token_ids": [1, 2, 3]})[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate({"prompt_token_ids": [1, 2, 3]})
    app = build_app(_RecordingEngine(gguf_tokenizer(default_model_path())),
                    EngineConfig(model=path, runner="pooling"))
    with TestClient(app, raise_server_exceptions=False) as http:
        for route, body in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                            ("/v1/responses", {"input": "hi"})):
            r = http.post(route, json=body)
            assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]


def test_matryoshka_dimensions_follow_the_config():
    from types import SimpleNamespace

    declared = PoolerConfig.from_model("/nonexistent", SimpleNamespace(
        hidden_size=64, matryoshka_dimensions=[16, 32, 64]))
    assert declared.params(32) == PoolingParams("LAST", True, 32)
    with pytest.raises(ValueError, match="one of"):
        declared.params(20)
    anysize = PoolerConfig.from_model("/nonexistent", SimpleNamespace(hidden_size=64,
                                                                      is_matryoshka=True))
    assert anysize.params(20).dimensions == 20
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        anysize.params(65)
    with pytest.raises(ValueError, match="Matryoshka"):
        PoolerConfig.from_model("/nonexistent", SimpleNamespace(hidden_size=64)).params(8)


def test_tensor_parallel_embeddings_equal_one_rank(tmp_path):
    """Two worker processes (gloo): the vector comes back from rank 0 through the
    executor's reply and equals the single-process one."""
    path = str(tmp_path / "plain")
    save_tiny_model(path, "qwen3", vocab_size=256)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 255 + 1 for j in range(5 + 9 * i)]}
               for i in range(4)]
    kw = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, max_model_len=128,
              max_num_batched_tokens=BUDGET)
    want = [o.outputs.embedding for o in LLM(path, **kw).embed(prompts)]
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        got = [o.outputs.embedding for o in llm.embed(prompts)]
    finally:
        llm.engine.shutdown()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                  {"num_speculative_tokens": 2}], ids=["ngram", "draft-model"])
def test_embeddings_beside_speculative_decodes(tmp_path, spec):
    """Pooling chunks in the steps that verify drafts: the vectors are HF's hidden states
    and the decodes keep HF's greedy tokens (a verify step counts its rows per sampled
    request, and pooling requests are not among them)."""
    path = str(tmp_path / "plain")
    model = save_tiny_model(path, "qwen3", vocab_size=256)
    if "method" not in spec:
        spec = {**spec, "model": path}  # its own draft
    llm = make_llm(path, skip_tokenizer_init=True, speculative_config={**spec, "max_batch_size": 8})
    rng = np.random.default_rng(1)
    loop = rng.integers(0, 256, 6).tolist() * 4  # repeats: n-gram drafts come up
    eng = llm.engine
    eng.add_request("g", None, loop, SamplingParams(temperature=0, max_tokens=20))
    eng.step()
    eng.step()
    prompts = [rng.integers(0, 256, n).tolist() for n in (7, 30)]
    done = {}
    for i, ids in enumerate(prompts):
        eng.add_pooling_request(f"e{i}", None, ids)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    for i, ids in enumerate(prompts):
        np.testing.assert_allclose(done[f"e{i}"].outputs.embedding, hf_last_token(model, ids),
                                   rtol=1e-4, atol=1e-5)
    assert done["g"].outputs[0].token_ids == hf_greedy(model, loop, 20)[0]
    assert eng.stats().spec_num_draft_tokens > 0


def hf_bidirectional_last_token(model, ids: list[int]) -> np.ndarray:
    """The reference for `is_causal: false`: HF's decoder given an all-visible 4D mask (no
    causal triangle), its last token's final hidden state, normalized."""
    with torch.no_grad():
        mask = torch.zeros(1, 1, len(ids), len(ids))
        h = model.model(torch.tensor([ids]), attention_mask=mask).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=-1).numpy()


def test_bidirectional_embedding_model(tmp_path):
    """gte-Qwen2's `is_causal: false` (in config.json, or through hf_overrides): with the
    pooling runner every input token sees every other, as HF's decoder with a full mask;
    inputs longer than the step budget are read whole (the budget is raised to
    max_model_len), several in one step. The generate runner stays causal."""
    causal_dir = str(tmp_path / "causal")
    model = save_tiny_model(causal_dir, "qwen2", vocab_size=256)
    bidir_dir = str(tmp_path / "gte")
    shutil.copytree(causal_dir, bidir_dir)
    with open(os.path.join(bidir_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(bidir_dir, "config.json"), "w") as f:
        json.dump({**cfg, "is_causal": False}, f)
    rng = np.random.default_rng(3)
    # BUDGET is 16; 200 + 120 exceed one step's 256 tokens: the second waits for the next step
    prompts = [rng.integers(0, 256, n).tolist() for n in (40, 5, 23, 1, 64, 200, 120)]
    llm = make_llm(bidir_dir, skip_tokenizer_init=True, runner="pooling")
    assert llm.engine.config.max_num_batched_tokens == 256  # max_model_len: inputs read whole
    got = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts])]
    for p, g in zip(prompts, got, strict=True):
        np.testing.assert_allclose(g, hf_bidirectional_last_token(model, p), rtol=1e-4, atol=1e-5)
        if len(p) > 1:  # a causal reading is another vector
            assert not np.allclose(g, hf_last_token(model, p), atol=1e-3)
    # The same through hf_overrides on the causal checkpoint.
    over = make_llm(causal_dir, skip_tokenizer_init=True, runner="pooling", hf_overrides={"is_causal": False})
    np.testing.assert_allclose(over.embed({"prompt_token_ids": prompts[0]})[0].outputs.embedding, got[0],
                               rtol=1e-5, atol=1e-6)
    # The generate runner cannot decode bidirectionally: it serves the checkpoint causal.
    gen = make_llm(bidir_dir, skip_tokenizer_init=True)
    assert gen.engine.config.max_num_batched_tokens == BUDGET
    np.testing.assert_allclose(gen.embed({"prompt_token_ids": prompts[0]})[0].outputs.embedding,
                               hf_last_token(model, prompts[0]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="hf_overrides"):
        LLM(model=causal_dir, hf_overrides="[1")


@pytest.mark.parametrize(("pooling", "want"), [({"pooling_mode": "mean_sqrt_len_tokens"}, "MEAN_SQRT_LEN"),
                                               ({"pooling_mode": ["max"]}, "MAX"),
                                               ({"pooling_mode_cls_token": True}, "CLS"),
                                               ({"pooling_mode": "weightedmean"}, None),
                                               ({"pooling_mode": ["mean", "max"]}, None)])
def test_pooling_config_spellings(tmp_path, pooling, want):
    """1_Pooling/config.json as sentence-transformers >= 6 writes it (`pooling_mode`) and as
    older releases did (`pooling_mode_*` flags), with its newer module class paths; a
    pooling this engine lacks (weighted mean, two at once) is refused."""
    from types import SimpleNamespace

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 64, **pooling}))
    cfg = SimpleNamespace(hidden_size=64)
    if want is None:
        with pytest.raises(ValueError, match="selects a pooling"):
            PoolerConfig.from_model(str(tmp_path), cfg)
    else:
        got = PoolerConfig.from_model(str(tmp_path), cfg)
        assert (got.pooling_type, got.normalize) == (want, False)
