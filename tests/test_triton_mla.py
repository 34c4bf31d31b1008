"""The Triton MLA decode and latent write (attention/mla_triton.py) against the torch
reference (attention/mla.py) on random latent pages: head counts below, at and above a
program's block of heads, contexts across pages, padding rows as CUDA-graph batches have.

Runs on CUDA; with TRITON_INTERPRET=1 and Triton installed it also runs on the CPU."""

from __future__ import annotations

import pytest
import torch
from paged_batch import latent_batch, paged_meta
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.attention import mla_triton
from pagedllm.attention.mla import _decode_absorbed, write_latent

CASES = [
    # (heads, rank, rope, page, contexts)
    (4, 32, 8, 4, [1, 5, 17, 33]),
    (16, 64, 16, 16, [3, 40, 129]),
    (20, 32, 8, 8, [70, 9]),  # two blocks of heads, the second partly empty
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_decode_matches_torch(case, dtype):
    heads, rank, rope, page, ctxs = case
    cache, args, (tables, slots, q_start, ql, ctx) = latent_batch([(1, c) for c in ctxs], heads, rank, rope,
                                                                  page, dtype)
    meta = paged_meta(tables, slots, q_start, ql, ctx, len(ctxs), 16, DEV)
    cache = cache.to(DEV)
    q_nope, q_pe, w_uk, w_uv = (args[k].to(DEV) for k in ("q_nope", "q_pe", "w_uk", "w_uv"))
    want = _decode_absorbed(q_nope.float(), q_pe.float(), cache.float(), meta, 0.3, w_uk.float(), w_uv.float())
    q = torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1)
    o_lat = mla_triton.decode(q, cache, meta.block_tables, meta.ctx_len, 0.3, rank)
    got = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_write_matches_torch_and_skips_padding():
    cache = torch.zeros(4, 8, 40, device=DEV)
    latent = torch.randn(3, 40, device=DEV)
    slots = torch.tensor([5, -1, 9], device=DEV, dtype=torch.int32)
    mla_triton.write_latent(latent, cache, slots)
    ref = torch.zeros_like(cache)
    write_latent(latent[[0, 2]], ref, slots[[0, 2]])
    assert torch.equal(cache, ref)


@pytest.mark.skipif(DEV != "cuda", reason="fp8 pages in Triton need a CUDA device")
def test_decode_over_fp8_pages():
    """e4m3 pages (scale 1) read back in the compute dtype: the same as a float cache
    holding the rounded values."""
    cache, args, (tables, slots, q_start, ql, ctx) = latent_batch([(1, c) for c in (7, 30, 65)], 16, 64, 16,
                                                                  16, torch.bfloat16)
    meta = paged_meta(tables, slots, q_start, ql, ctx, 3, 16, DEV)
    fp8 = cache.to(DEV).to(torch.float8_e4m3fn)
    q = torch.cat((torch.einsum("thd,hdr->thr", args["q_nope"], args["w_uk"]), args["q_pe"]), dim=-1).to(DEV)
    got = mla_triton.decode(q, fp8, meta.block_tables, meta.ctx_len, 0.3, 64)
    want = mla_triton.decode(q, fp8.to(torch.bfloat16), meta.block_tables, meta.ctx_len, 0.3, 64)
    torch.testing.assert_close(got, want)


def test_engine_with_mla_kernels_matches_hf(tmp_path, monkeypatch):
    """The whole engine with the Triton latent write and decode (on the CPU: in the
    interpreter) generates what transformers generates, prompts chunked beside decodes."""
    import random

    from hf_models import hf_greedy, save_tiny_deepseek

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.models.deepseek import MlaAttention

    hf = save_tiny_deepseek(str(tmp_path), "v2")
    if DEV == "cpu":
        monkeypatch.setattr(mla_triton, "available", lambda cache: True)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, device=DEV, dtype="float32", block_size=4,
              num_kv_blocks=128, max_num_batched_tokens=24, enforce_eager=True)
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, MlaAttention)]
    for m in layers:
        m.kernels = True  # the Triton backend's choice; on the CPU the engine runs the torch one
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        toks = o.outputs[0].token_ids
        ref_toks, ref_lps = hf_greedy(hf, p, 6)
        assert toks == ref_toks
        assert [d[t].logprob for d, t in zip(o.outputs[0].logprobs, toks, strict=True)] == pytest.approx(
            ref_lps, abs=1e-4)
