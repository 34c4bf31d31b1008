"""Mixture-of-Experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE) saved by transformers
generate what transformers generates (greedy tokens equal, logprobs close) for a batch of
prompts, and the checks are sharp enough to see the routing: top-1 instead of top-2, or
a missing renormalisation, changes the result."""

from __future__ import annotations

import random

import pytest
import torch
from hf_models import hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.model_executor.models.moe import MoeForCausalLM, SparseMoeBlock

MAX_NEW = 8
# 4 experts, top-2; Qwen2-MoE with a shared expert and a dense layer (mlp_only_layers);
# Qwen3-MoE renormalising the top-k weights (Qwen2-MoE's default does not).
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
}


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=1, ignore_eos=True)
    res = []
    for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
        got = o.outputs[0]
        res.append((got.token_ids, [pos[t].logprob for pos, t in zip(got.logprobs, got.token_ids,
                                                                         strict=True)]))
    return res


def _matches(results, hf, prompts) -> bool:
    for p, (toks, lps) in zip(prompts, results, strict=True):
        ref_toks, ref_lps = hf_greedy(hf, p, MAX_NEW)
        if toks != ref_toks or lps != pytest.approx(ref_lps, abs=1e-4):
            return False
    return True


def _blocks(llm: LLM) -> list[SparseMoeBlock]:
    model = llm.engine.executor.model
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("model_type", list(MOE))
def test_moe_batch_parity_and_routing_matters(tiny_models, model_type):
    path, hf = tiny_models(model_type, **MOE[model_type])
    prompts = _prompts(5, seed=1)
    # a small token budget: prompts are chunked and decodes share steps with prefills
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=24)
    assert _matches(_run(llm, prompts), hf, prompts)
    blocks = _blocks(llm)
    assert len(blocks) == (1 if model_type == "qwen2_moe" else 2)  # layer 1 is dense there
    if model_type == "qwen2_moe":
        assert blocks[0].shared_expert is not None
    for b in blocks:  # the same model routed to one expert per token must not pass
        b.top_k = 1
    assert not _matches(_run(llm, prompts), hf, prompts)


def test_qwen3_moe_renormalisation_matters(tiny_models):
    path, hf = tiny_models("qwen3_moe", **MOE["qwen3_moe"])
    prompts = _prompts(3, seed=2)
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=128)
    for b in _blocks(llm):
        b.norm_topk_prob = False
    assert not _matches(_run(llm, prompts), hf, prompts)


def test_fused_expert_layout(tiny_models, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I], `mlp.` prefix) loads as well as the per-expert tensors save_pretrained writes."""
    from safetensors.torch import save_file

    _, hf = tiny_models("mixtral", **MOE["mixtral"])
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    prompts = _prompts(3, seed=3)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    assert _matches(_run(llm, prompts), hf, prompts)


def test_dense_expert_path_equals_sparse(tiny_models):
    """The graph-capturable path (every expert on every token, zero-weighted where not
    chosen) computes what the sparse one does."""
    path, _ = tiny_models("qwen2_moe", **MOE["qwen2_moe"])
    llm = LLM(model=path, skip_tokenizer_init=True, block_size=4, num_kv_blocks=16)
    block = _blocks(llm)[0]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w, ids = block.route(x)
        assert torch.allclose(block.experts_dense(x, w, ids), block.experts_sparse(x, w, ids),
                              atol=1e-5)


def test_missing_expert_and_quantized_checkpoints_fail_clearly(tiny_models):
    path, hf = tiny_models("mixtral", **MOE["mixtral"])
    with torch.device("meta"):
        model = MoeForCausalLM(hf.config, "MixtralForCausalLM", 64, None)
    weights = [(k, v) for k, v in _per_expert_names(hf)
               if k != "model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    model = model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"missing 1 expert tensors of model.layers.1.mlp.*\(3, 'down'\)"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="quantized MixtralForCausalLM checkpoints are not supported"):
        MoeForCausalLM(hf.config, "MixtralForCausalLM", 64, None, quant=object())


def _per_expert_names(hf):
    """The HF model's tensors under the checkpoint names save_pretrained uses for Mixtral."""
    for k, v in hf.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for e, t in enumerate(v):
                gate, up = t.chunk(2)
                yield k.replace("mlp.experts.gate_up_proj", f"block_sparse_moe.experts.{e}.w1.weight"), gate
                yield k.replace("mlp.experts.gate_up_proj", f"block_sparse_moe.experts.{e}.w3.weight"), up
        elif k.endswith("mlp.experts.down_proj"):
            for e, t in enumerate(v):
                yield k.replace("mlp.experts.down_proj", f"block_sparse_moe.experts.{e}.w2.weight"), t
        else:
            yield k.replace(".mlp.gate.", ".block_sparse_moe.gate."), v


def test_tp2_moe_equals_tp1(tiny_models):
    """Experts and the shared expert split over two ranks (gloo on CPU)."""
    path, _ = tiny_models("qwen2_moe", **MOE["qwen2_moe"])
    prompts = _prompts(3, seed=4)
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    want = _run(LLM(path, **kw), prompts)
    llm = LLM(path, tensor_parallel_size=2, **kw)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        got = _run(llm, prompts)
    finally:
        llm.engine.shutdown()
    for (t1, l1), (t2, l2) in zip(want, got, strict=True):
        assert t1 == t2
        assert l1 == pytest.approx(l2, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_cuda_moe_with_graphs_matches_eager_and_hf(tiny_models, model_type):
    """On CUDA every MoE layer runs the fused kernels (layers/fused_moe.py), replayed from
    CUDA graphs in decode steps and eagerly in prefills: both agree with transformers
    (float32 on the CPU) and with the same engine run eagerly."""
    path, hf = tiny_models(model_type, **MOE[model_type])
    prompts = _prompts(6, seed=3)
    runs = []
    for eager in (False, True):
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", device="cuda",
                  num_kv_blocks=256, enforce_eager=eager, max_num_seqs=16)
        assert (llm.engine.executor.runner.graphs is None) == eager
        runs.append(_run(llm, prompts))
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    for p, (toks, lps) in zip(prompts, runs[0], strict=True):
        ref_toks, ref_lps = hf_greedy(hf, p, MAX_NEW)
        assert toks == ref_toks
        assert lps == pytest.approx(ref_lps, abs=1e-3)
