"""The fused draw (pagedllm/model_executor/layers/sampler_kernels.py) against the inverse
CDF computed in float64: the same token wherever u is not within rounding of a boundary,
never a token of zero weight, and the Sampler's tokens equal to its tensor-op path.

Runs on CUDA; with TRITON_INTERPRET=1 and Triton installed it also runs on the CPU
(tests/test_sampling.py starts it so)."""

from __future__ import annotations

import pytest
import torch
from triton_device import DEV  # first: skips this module without CUDA or the interpreter

from pagedllm.model_executor.layers import sampler_kernels
from pagedllm.model_executor.layers.sampler import Sampler, SamplingBatch


def _reference_cdf(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).double()
    return (logits.double() / t[:, None]).softmax(-1).cumsum(-1)


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, ::7] = float("-inf")  # masked tokens (a grammar, a bias of -inf)
    return x


# vocabularies of one split, of several with a short last one, and of a few tokens
@pytest.mark.parametrize("vocab", [50, 4096, 9000])
def test_draw_takes_the_token_whose_cdf_step_holds_u(vocab):
    """u at the midpoint of a chosen token's CDF step draws exactly that token, at any
    temperature (0 counts as 1: the caller takes greedy rows' argmax)."""
    rows = 12
    x = _logits(rows, vocab, seed=vocab)
    temp = torch.tensor([0.5, 1.0, 2.0, 0.0] * 3)
    cdf = _reference_cdf(x, temp)
    p = torch.diff(cdf, dim=-1, prepend=torch.zeros(rows, 1, dtype=cdf.dtype))
    g = torch.Generator().manual_seed(1)
    want = torch.multinomial((p > 1e-4).double(), 1, generator=g).squeeze(1)  # a token of visible weight
    lo = torch.where(want > 0, cdf.gather(1, (want - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros(rows).double())
    hi = cdf.gather(1, want[:, None]).squeeze(1)
    u = ((lo + hi) / 2 / cdf[:, -1]).float()
    got = sampler_kernels.draw(x.to(DEV), temp.to(DEV), u.to(DEV)).cpu()
    assert got.tolist() == want.tolist()


def test_zero_weight_tokens_are_never_drawn():
    """Only tokens with a finite logit come out, for u from 0 to just under 1 (where
    rounding can leave u * total past the last sum: the last finite token then)."""
    vocab, rows = 9000, 16
    x = torch.full((rows, vocab), float("-inf"))
    finite = torch.tensor([3, 4100, 4101, 8500])  # in three of the three splits' ranges
    x[:, finite] = torch.tensor([0.0, 1.0, -1.0, 2.0])
    u = torch.linspace(0, 1, rows)
    u[-1] = 1.0  # the far end: u * total is the whole sum
    got = sampler_kernels.draw(x.to(DEV), torch.ones(rows, device=DEV), u.to(DEV)).cpu()
    assert set(got.tolist()) <= set(finite.tolist())
    assert got[0].item() == 3 and got[-1].item() == 8500
    assert got.tolist() == sorted(got.tolist())  # the inverse CDF is monotone in u


def test_random_draws_equal_the_float64_inverse_cdf():
    """Random u (away from boundaries by more than rounding): the float64 inverse CDF's
    token, on bf16 logits as the model hands them over."""
    rows, vocab = 64, 9000
    x = _logits(rows, vocab, seed=3).to(torch.bfloat16)
    temp = torch.rand(rows, generator=torch.Generator().manual_seed(4)) + 0.3
    u = torch.rand(rows, generator=torch.Generator().manual_seed(5))
    cdf = _reference_cdf(x.float(), temp)
    target = u.double() * cdf[:, -1]
    want = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    gap = torch.minimum((cdf - target[:, None]).abs().min(-1).values, target)  # distance to a boundary
    got = sampler_kernels.draw(x.to(DEV), temp.to(DEV), u.to(DEV)).cpu()
    clear = gap > 1e-5
    assert clear.sum() >= rows - 2
    assert got[clear].tolist() == want[clear].tolist()


def test_sampler_draws_the_same_tokens_either_way(monkeypatch):
    """The Sampler with the kernels equals its tensor-op path (same uniforms from the same
    seed), greedy rows their argmax; a row with top-p keeps the whole batch on tensor ops."""
    rows, vocab = 32, 5000
    x = _logits(rows, vocab, seed=6).to(DEV)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * 8, device=DEV)
    batch = SamplingBatch(temperature=temp, num_logprobs=[None] * rows)
    calls = []
    draw = sampler_kernels.draw

    def counted(*a):
        calls.append(1)
        return draw(*a)

    monkeypatch.setattr(sampler_kernels, "draw", counted)
    monkeypatch.setattr(sampler_kernels, "usable", lambda logits, k, p, m: k is None and p is None and m is None)
    fused = Sampler(torch.Generator(device=DEV).manual_seed(9)).sample(x, batch).token_ids.cpu()
    assert calls == [1]
    monkeypatch.setattr(sampler_kernels, "usable", lambda *a: False)
    plain = Sampler(torch.Generator(device=DEV).manual_seed(9)).sample(x, batch).token_ids.cpu()
    assert fused.tolist() == plain.tolist()
    assert fused[::4].tolist() == x[::4].argmax(-1).cpu().tolist()
    monkeypatch.setattr(sampler_kernels, "usable", lambda logits, k, p, m: k is None and p is None and m is None)
    batch.top_p = torch.ones(rows, device=DEV)
    Sampler(torch.Generator(device=DEV).manual_seed(9)).sample(x, batch)
    assert calls == [1]


def test_the_switch_is_on_by_default(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_FUSED_SAMPLER", raising=False)
    assert sampler_kernels.enabled()
    monkeypatch.setenv("PAGEDLLM_FUSED_SAMPLER", "0")
    assert not sampler_kernels.enabled()


def test_low_precision_logits_are_not_copied_to_float(monkeypatch):
    """Logits in the model's dtype go to the kernels (and the argmax) as they are when no
    row needs them processed: the same tokens as from their float32 copy; a row asking
    for logprobs makes the copy (its raw logprobs are float32) and keeps the tokens. No
    greedy row (any_greedy False): no argmax at all, the same draws."""
    if DEV != "cuda":
        pytest.skip("bf16 logits: CUDA (the interpreter's bf16 is not CUDA's)")
    rows, vocab = 16, 9000
    x = _logits(rows, vocab, seed=11).to(DEV, torch.bfloat16)
    temp = torch.tensor([0.0, 0.8, 1.0, 1.5] * 4, device=DEV)
    seen = []
    draw = sampler_kernels.draw
    monkeypatch.setattr(sampler_kernels, "draw", lambda logits, *a: seen.append(logits.dtype) or draw(logits, *a))

    def sample(logits, batch):
        return Sampler(torch.Generator(device=DEV).manual_seed(4)).sample(logits, batch)

    batch = SamplingBatch(temperature=temp, num_logprobs=[None] * rows)
    low = sample(x, batch).token_ids.cpu()
    full = sample(x.float(), batch).token_ids.cpu()
    assert seen == [torch.bfloat16, torch.float32]
    assert low.tolist() == full.tolist()
    with_lp = sample(x, SamplingBatch(temperature=temp, num_logprobs=[1] + [None] * (rows - 1)))
    assert seen[-1] == torch.float32 and with_lp.token_ids.cpu().tolist() == low.tolist()
    assert with_lp.sel is not None and with_lp.sel.dtype == torch.float32
    sampled = SamplingBatch(temperature=torch.full((rows,), 0.9, device=DEV), num_logprobs=[None] * rows)
    either = sample(x, sampled).token_ids.cpu()
    sampled.any_greedy = False
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("argmax without greedy rows"))
    assert sample(x, sampled).token_ids.cpu().tolist() == either.tolist()
