"""The fused MoE kernels (model_executor/layers/fused_moe.py) against a per-token loop
over the chosen experts: empty experts, one token, every token on one expert, k = 1, 2,
8, 128 experts, float32 and bfloat16, and the block layout `align_pairs` builds.

Runs on CUDA; with TRITON_INTERPRET=1 and Triton installed it also runs on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_device import DEV, INTERPRET  # first: skips this module without CUDA or the interpreter

from pagedllm.model_executor.layers import fused_moe
from pagedllm.model_executor.layers.fused_moe import align_pairs, fused_experts, route, route_align


def _reference(x, w13, w2, weights, ids):
    x, w13, w2, weights = x.float(), w13.float(), w2.float(), weights.float()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(x[t] @ w13[e, :inter].t()) * (x[t] @ w13[e, inter:].t())
            out[t] += weights[t, j] * (h @ w2[e].t())
    return out


CASES = [  # tokens, experts, k, hidden, inter, how tokens route
    (1, 8, 2, 64, 32, "random"),
    (1, 128, 8, 64, 32, "random"),
    (3, 128, 8, 80, 300, "random"),  # columns and K masked
    (4, 16, 2, 64, 32, "one_expert"),
    (7, 4, 1, 48, 40, "random"),
    (33, 16, 2, 64, 32, "one_expert"),
    (20, 8, 8, 32, 16, "random"),
    (40, 128, 8, 64, 32, "random"),
]


@pytest.mark.parametrize("tokens,experts,k,hidden,inter,routing", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_equal_the_per_token_loop(tokens, experts, k, hidden, inter, routing, dtype):
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("the interpreter computes bfloat16 dots wrongly")
    g = torch.Generator().manual_seed(tokens * 131 + experts)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(tokens, experts, generator=g)
    if routing == "one_expert":  # all tokens on experts 0..k-1, the rest empty
        logits[:, :k] += 100.0
    weights, ids = torch.topk(logits.softmax(-1), k)
    want = _reference(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    for cfg in (None, {"BM": 16, "BN": 32, "BK": 16}):
        got = fused_experts(x.to(DEV, dtype), w13.to(DEV, dtype), w2.to(DEV, dtype),
                            weights.to(DEV), ids.to(DEV), cfg).float().cpu()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (3, 8, 4), (33, 4, 2), (20, 32, 4)])
def test_fused_experts_with_biases_and_clamped_swiglu(tokens, experts, k):
    """gpt-oss's experts: gate/up and down biases and the clamped SwiGLU, against
    SparseMoeBlock's per-expert torch path (models/moe.py, checked against transformers)."""
    from pagedllm.model_executor.models.moe import Activation

    g = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 64, 32
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.3
    b13 = torch.randn(experts, 2 * inter, generator=g)
    b2 = torch.randn(experts, hidden, generator=g)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), k)
    act = Activation("clamped_swiglu", 1.702, 1.5)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            gate_up = x[t] @ w13[e].t() + b13[e]
            h = act(gate_up[:inter], gate_up[inter:])
            want[t] += weights[t, j] * (h @ w2[e].t() + b2[e])
    assert (x @ w13[0, :inter].t() + b13[0, :inter]).abs().max() > 1.5  # the clamp bites
    got = fused_experts(x.to(DEV), w13.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV),
                        b13=b13.to(DEV), b2=b2.to(DEV), swiglu=(1.702, 1.5)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens,experts,k,hidden,inter", [(1, 8, 2, 64, 32), (20, 4, 2, 96, 64), (9, 32, 4, 64, 96)])
def test_fused_experts_on_packed_mxfp4_equal_the_dequantized(tokens, experts, k, hidden, inter):
    """gpt-oss's MXFP4 experts kept packed: the kernels dequantize K tile by K tile (hidden
    96 and inter 96 end in a half tile) what models/gpt_oss.dequantize_mxfp4 (checked
    against transformers) dequantizes whole."""
    from pagedllm.model_executor.models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g)

    def packed(rows, cols):
        return (torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=g),
                torch.randint(119, 125, (experts, rows, cols // 32), dtype=torch.uint8, generator=g))

    (w13, s13), (w2, s2) = packed(2 * inter, hidden), packed(hidden, inter)
    b13, b2 = torch.randn(experts, 2 * inter, generator=g), torch.randn(experts, hidden, generator=g)
    weights, ids = torch.topk(torch.randn(tokens, experts, generator=g).softmax(-1), k)

    def float_w(w, sc):
        return dequantize_mxfp4(w.view(*w.shape[:2], -1, 16), sc, torch.float32)

    for kw in ({}, {"b13": b13, "b2": b2, "swiglu": (1.702, 7.0)}):
        want = fused_experts(x.to(DEV), float_w(w13, s13).to(DEV), float_w(w2, s2).to(DEV), weights.to(DEV),
                             ids.to(DEV), **{a: (v.to(DEV) if torch.is_tensor(v) else v) for a, v in kw.items()})
        for cfg in (None, {"BM": 16, "BN": 32, "BK": 16}):
            got = fused_experts(x.to(DEV), w13.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV), cfg,
                                w13_scale=s13.to(DEV), w2_scale=s2.to(DEV),
                                **{a: (v.to(DEV) if torch.is_tensor(v) else v) for a, v in kw.items()})
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()))


def test_align_pairs_gives_each_block_one_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEV)
    sorted_ids, block_expert, used = align_pairs(ids, num_experts=5, block_m=4)
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    flat = ids.reshape(-1).cpu()
    pairs = flat.numel()
    n_used = int(used)
    assert n_used == 4 * 4  # experts 0 (2 pairs), 1, 2 (1 each), 3 (4): one block each
    for b in range(n_used // 4):
        rows = sorted_ids[b * 4:(b + 1) * 4]
        real = rows[rows < pairs]
        assert len(real) > 0 and all(int(flat[r]) == int(block_expert[b]) for r in real)
    seen = sorted(int(r) for r in sorted_ids[:n_used] if r < pairs)
    assert seen == list(range(pairs))  # every pair exactly once, expert 4 has no block


@pytest.mark.parametrize("tokens,experts,k,block_m", [(1, 8, 2, 16), (1, 128, 8, 16),
                                                      (37, 16, 4, 32), (256, 128, 8, 16)])
def test_the_one_kernel_alignment_equals_the_torch_one(tokens, experts, k, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.topk(torch.rand(tokens, experts, generator=g), k).indices.to(DEV)
    a = align_pairs(ids, experts, block_m, one_kernel=True)
    b = align_pairs(ids, experts, block_m, one_kernel=False)
    used = int(b[2])
    assert int(a[2]) == used
    assert torch.equal(a[0][:used].cpu(), b[0][:used].cpu())
    assert torch.equal(a[1][:used // block_m].cpu(), b[1][:used // block_m].cpu())


@pytest.mark.parametrize("renormalise", [False, True])
def test_route_is_transformers_routing(renormalise):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(13, 128, generator=g)
    want_w, want_i = torch.topk(logits.softmax(-1), 8)
    if renormalise:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    w, i = route(logits.to(DEV), 8, renormalise)
    assert torch.equal(i.cpu().long(), want_i)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens,experts,k,block_m,renormalise",
                         [(1, 8, 2, 16, True), (1, 128, 8, 16, True), (5, 4, 1, 16, False),
                          (37, 16, 4, 32, True), (64, 128, 8, 16, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_align_equals_route_then_align(tokens, experts, k, block_m, renormalise, dtype):
    """The one-program routing + alignment of decode steps gives route()'s weights (cast
    to `dtype` after the float32 renormalisation, as Qwen's block casts them) and ids and
    align_pairs()'s blocks."""
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    logits = torch.randn(tokens, experts, generator=g).to(DEV)
    want_w, want_i = route(logits, k, renormalise)
    want = align_pairs(want_i, experts, block_m)
    w, i, got = route_align(logits, k, renormalise, block_m, dtype)
    assert torch.equal(i, want_i)
    assert w.dtype == dtype
    # bfloat16: within its rounding of route()'s value (half a unit in the last place, 2^-8
    # relative): the float32 sums differ in order, so a value on a rounding boundary may go
    # either way. Triton's interpreter casts by truncation (a whole unit, 2^-7).
    rtol = 1e-6 if dtype == torch.float32 else 2**-7 if INTERPRET else 2**-8
    torch.testing.assert_close(w.float(), want_w, rtol=rtol, atol=1e-7)
    used = int(want[2])
    assert int(got[2]) == used
    assert torch.equal(got[0][:used], want[0][:used])
    assert torch.equal(got[1][:used // block_m], want[1][:used // block_m])
    with pytest.raises(ValueError, match="tokens"):
        route_align(torch.zeros(65, experts, device=DEV), k, renormalise, block_m)


@pytest.mark.parametrize("tokens", [1, 9, 64, 65])
def test_moe_block_with_route_align_equals_separate_launches(tokens, monkeypatch):
    """A Qwen-style MoE block (softmax top-k, renormalised, Qwen's cast of the weights):
    steps of up to 64 tokens take the fused route + align launch, larger ones the two
    launches; both equal the block's per-expert torch loop."""
    from pagedllm.model_executor.models.moe import SparseMoeBlock

    class Shape:  # what SparseMoeBlock reads of a ModelShape
        hidden = 64

    torch.manual_seed(tokens)
    block = SparseMoeBlock(Shape(), num_experts=16, top_k=4, intermediate=32, norm_topk_prob=True,
                           weights_in_fp32=False)
    with torch.no_grad():
        for prm in block.parameters():
            prm.normal_(0.0, 0.3)
    block = block.to(DEV)
    x = torch.randn(tokens, 64, device=DEV)
    with torch.no_grad():
        want = block.experts_sparse(x, *block.route(x))
        monkeypatch.setattr(fused_moe, "available", lambda t: True)
        calls = []
        real = fused_moe.route_align
        monkeypatch.setattr(fused_moe, "route_align", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = block(x)
    assert len(calls) == (1 if tokens <= fused_moe.ROUTE_ALIGN_TOKENS else 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_packed_mxfp4_expert_block_equals_its_dequantized_twin(tmp_path, monkeypatch):
    """gpt-oss's published MXFP4 checkpoint loaded into packed experts (their rows
    de-interleaved into gate and up, as CUDA keeps them) computes, through the fused kernels,
    what the same checkpoint dequantized at load computes on the torch path."""
    from safetensors import safe_open
    from test_models_gpt_oss import _mxfp4_pair, _reference

    from pagedllm.attention import TorchPagedAttention
    from pagedllm.model_executor.layers.quantization import QuantConfig
    from pagedllm.model_executor.models.gpt_oss import GptOssForCausalLM, Mxfp4Experts

    hf = _reference()
    qdir, _, _ = _mxfp4_pair(hf, tmp_path)

    def load(quant):
        with torch.device("meta"):
            model = GptOssForCausalLM(hf.config, "GptOssForCausalLM", 64, TorchPagedAttention, quant=quant)
        model = model.to_empty(device=DEV)
        pairs = []
        for f in sorted((tmp_path / "mxfp4").glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                pairs += [(k, st.get_tensor(k)) for k in st.keys()]
        model.load_weights(pairs)
        return model

    packed, dequantized = load(QuantConfig.default("mxfp4")), load(None)
    x = torch.randn(11, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        want = [layer.mlp.experts_sparse(x, *layer.mlp.route(x)) for layer in dequantized.model.layers]
        monkeypatch.setattr(fused_moe, "available", lambda t: True)
        for layer, w in zip(packed.model.layers, want, strict=True):
            assert isinstance(layer.mlp, Mxfp4Experts) and layer.mlp.w13.dtype == torch.uint8
            torch.testing.assert_close(layer.mlp(x), w, rtol=1e-4, atol=1e-4)
