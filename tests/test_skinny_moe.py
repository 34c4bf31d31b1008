"""The one-token expert kernels (layers/skinny_moe.py) against a per-token loop over the
chosen experts, their routing against transformers' (softmax, top k, renormalised), and
where the engine takes them.

The kernel tests run on CUDA, or on the CPU in Triton's interpreter (a fresh process,
test_the_kernels_in_the_interpreter): float32 there, bfloat16 on a card."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import kernel_device, run_interpreted

from pagedllm.model_executor.layers import skinny_moe


def _reference(x, w13, w2, weights, ids, b13=None, b2=None, act=None):
    x, w13, w2, weights = x.float(), w13.float(), w2.float(), weights.float()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = x[t] @ w13[e].t() + (0 if b13 is None else b13[e].float())
            gate, up = gate_up[:inter], gate_up[inter:]
            h = F.silu(gate) * up if act is None else act(gate, up)
            out[t] += weights[t, j] * (h @ w2[e].t() + (0 if b2 is None else b2[e].float()))
    return out


def _routing(logits, k, renormalise):
    """transformers' routing (models/moe.py's torch path)."""
    weights, ids = torch.topk(logits.float().softmax(-1), k)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


# tokens, experts, k, hidden, inter, config ("gBN,gBK,dBN,dBK" or None): rows and keys
# masked (inter 300 in tiles of 4 and 128; hidden 80 in tiles of 64), one and several tiles
CASES = [
    (1, 8, 2, 64, 32, None),
    (1, 128, 8, 256, 96, None),
    (1, 16, 6, 80, 300, (4, 64, 2, 128)),  # k = 6: the down tile's expert rows masked
    (2, 16, 4, 64, 48, (2, 32, 4, 16)),
    (3, 4, 1, 48, 40, (1, 16, 1, 16)),
]


def _problem(tokens, experts, k, hidden, inter, dev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + tokens * 131 + experts + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(tokens, experts, generator=g)
    return [t.to(dev, dtype) for t in (x, w13, w2, logits)]


def _config(cfg):
    if cfg is None:
        return None
    gbn, gbk, dbn, dbk = cfg
    return {"gate_bn": gbn, "gate_bk": gbk, "down_bn": dbn, "down_bk": dbk, "num_warps": 4}


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("tokens,experts,k,hidden,inter,cfg", CASES)
def test_routed_in_the_kernel_equals_the_loop(tokens, experts, k, hidden, inter, cfg, renormalise):
    pytest.importorskip("triton")
    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    x, w13, w2, logits = _problem(tokens, experts, k, hidden, inter, dev, dtype)
    weights, ids = _routing(logits, k, renormalise)
    want = _reference(x, w13, w2, weights, ids)
    got = skinny_moe.routed_experts(x, w13, w2, logits=logits, top_k=k, renormalise=renormalise,
                                    config=_config(cfg))
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("tokens,experts,k,hidden,inter,cfg", CASES)
def test_given_ids_and_weights_equal_the_loop(tokens, experts, k, hidden, inter, cfg):
    """Another routing's ids and weights (e.g. DeepSeek's grouped sigmoid), the same expert
    chosen twice by different tokens."""
    pytest.importorskip("triton")
    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    x, w13, w2, logits = _problem(tokens, experts, k, hidden, inter, dev, dtype, seed=1)
    weights, ids = torch.topk(logits.float().sigmoid(), k)
    ids = ids.to(torch.int32)
    if tokens > 1:
        ids[1] = ids[0]
    want = _reference(x, w13, w2, weights, ids)
    got = skinny_moe.routed_experts(x, w13, w2, weights=weights, ids=ids, config=_config(cfg))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_biases_and_clamped_swiglu():
    """gpt-oss's experts: gate/up and down biases and the clamped SwiGLU, against the torch
    Activation (models/moe.py, checked against transformers)."""
    pytest.importorskip("triton")
    from pagedllm.model_executor.models.moe import Activation

    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    x, w13, w2, logits = _problem(1, 8, 4, 64, 32, dev, dtype, seed=2)
    w13, w2 = w13 * 1.5, w2 * 1.5
    g = torch.Generator().manual_seed(5)
    b13 = torch.randn(8, 64, generator=g).to(dev, dtype)
    b2 = torch.randn(8, 64, generator=g).to(dev, dtype)
    act = Activation("clamped_swiglu", 1.702, 1.5)
    weights, ids = _routing(logits, 4, True)
    want = _reference(x, w13, w2, weights, ids, b13, b2, act)
    assert (x.float() @ w13[ids[0, 0], :32].float().t()).abs().max() > 1.5  # the clamp bites
    got = skinny_moe.routed_experts(x, w13, w2, logits=logits, top_k=4, renormalise=True, b13=b13, b2=b2,
                                    swiglu=(1.702, 1.5))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


def test_ties_pick_the_lowest_expert():
    """Equal logits: the k lowest indices, as _route_kernel and torch.topk on CUDA pick."""
    pytest.importorskip("triton")
    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    x, w13, w2, _ = _problem(1, 8, 2, 64, 32, dev, dtype, seed=3)
    logits = torch.zeros(1, 8, device=dev, dtype=dtype)
    want = _reference(x, w13, w2, torch.full((1, 2), 0.5), torch.tensor([[0, 1]]))
    got = skinny_moe.routed_experts(x, w13, w2, logits=logits, top_k=2, renormalise=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_the_kernels_in_the_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_skinny_moe.py",
                           "-k", "equals_the_loop or equal_the_loop or swiglu or ties"], 600)
    assert res.returncode == 0 and "17 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_which_steps_take_it(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(skinny_moe, "MAX_TOKENS", skinny_moe.DEFAULT_MAX_TOKENS)
    w13 = torch.zeros(4, 16, 32, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 32, 8, dtype=torch.bfloat16)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    assert not skinny_moe.applies(x, w13, w2)  # CPU: the torch loop
    if not torch.cuda.is_available():
        return
    w13, w2, x = w13.cuda(), w2.cuda(), x.cuda()
    assert skinny_moe.applies(x, w13, w2)
    assert skinny_moe.applies(torch.zeros(2, 32, dtype=torch.bfloat16, device="cuda"), w13, w2)
    assert not skinny_moe.applies(torch.zeros(3, 32, dtype=torch.bfloat16, device="cuda"), w13, w2)
    assert not skinny_moe.applies(x.float(), w13.float(), w2.float())
    monkeypatch.setattr(skinny_moe, "MAX_TOKENS", 0)  # PAGEDLLM_MOE_SKINNY_TOKENS=0
    assert not skinny_moe.applies(x, w13, w2)


def test_launch_config():
    pytest.importorskip("triton")
    cfg = skinny_moe.launch_config(2048, 768)  # Qwen3-30B-A3B
    assert (cfg["gate_bn"], cfg["gate_bk"], cfg["down_bn"], cfg["down_bk"]) == (4, 1024, 1, 128)
    cfg = skinny_moe.launch_config(40, 24)  # no tile wider than the sizes need
    assert (cfg["gate_bn"], cfg["gate_bk"], cfg["down_bk"]) == (2, 64, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_moe_block_takes_it_for_one_or_two_tokens(tokens, monkeypatch):
    """A Qwen-style block in bf16 on CUDA: one or two tokens go through skinny_moe (its
    routing in the kernel), three through route_align; all agree with the per-expert torch
    loop."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pagedllm.model_executor.models.moe import SparseMoeBlock

    class Shape:
        hidden = 256

    torch.manual_seed(tokens)
    block = SparseMoeBlock(Shape(), num_experts=64, top_k=8, intermediate=128, norm_topk_prob=True,
                           weights_in_fp32=False)
    with torch.no_grad():
        for prm in block.parameters():
            prm.normal_(0.0, 0.1)
    block = block.to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = skinny_moe.routed_experts
    monkeypatch.setattr(skinny_moe, "routed_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        want = block.experts_sparse(x, *block.route(x)).float()
        got = block(x).float()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = block(x)
        graph.replay()
    assert len(calls) == (2 if tokens <= 2 else 0)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    torch.testing.assert_close(replayed.float(), got, rtol=0, atol=0)
