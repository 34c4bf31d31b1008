"""The few-row product (layers/skinny_gemm.py) against torch's, and where the engine uses it.

The kernel tests run on CUDA, or on the CPU in Triton's interpreter (a fresh process,
test_the_kernel_in_the_interpreter): float32 inputs there, since the interpreter's bfloat16
rounding is not the card's."""

from __future__ import annotations

import pytest
import torch
from interpreted import kernel_device, run_interpreted

from pagedllm.model_executor.layers import skinny_gemm

# (m, n, k, config): N not a multiple of BN, K not a multiple of BK, one and several key tiles
CASES = [
    (1, 37, 200, (1, 8, 64, 4)),
    (2, 5, 72, (2, 4, 64, 4)),
    (3, 130, 136, (4, 16, 128, 4)),
    (4, 64, 512, (4, 2, 1024, 4)),
    (1, 3, 8, (1, 1, 64, 4)),
    (4, 96, 256, None),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,config", CASES)
def test_kernel_matches_torch(m, n, k, config, bias):
    pytest.importorskip("triton")
    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    w = torch.randn(n, k, generator=g).to(dev, dtype)
    b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
    y = skinny_gemm.skinny_linear(x, w, b, config=config)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * k ** 0.5)


FP8_CASES = [(1, 37, 208, (1, 8, 64, 4)), (2, 5, 80, (2, 4, 64, 4)), (1, 130, 1040, None), (4, 96, 256, None)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,config", FP8_CASES)
def test_fp8_weights_match_the_dequantized_product(m, n, k, config, bias):
    """e4m3 weights with one scale a row: x @ (weight * scale).T, the weight widened as it is
    read and each sum scaled once (N not a multiple of BN, K past one key tile)."""
    pytest.importorskip("triton")
    from pagedllm.model_executor.layers.quantization import fp8

    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dev, dtype)
    wq, ws = fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    wq, ws = wq.to(dev), ws.to(dev)
    b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
    y = skinny_gemm.skinny_linear(x, wq, b, config=config, scale=ws.reshape(-1))
    ref = x.float() @ (wq.float() * ws).T + (b.float() if bias else 0)
    assert y.shape == (m, n) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # the scale is applied: a layer whose scales double gives twice the product
    y2 = skinny_gemm.skinny_linear(x, wq, None, config=config, scale=(ws * 2).reshape(-1))
    torch.testing.assert_close(y2.float(), 2 * (x.float() @ (wq.float() * ws).T), rtol=tol,
                               atol=tol * ref.abs().max().item())


def test_a_row_does_not_depend_on_the_others():
    """Batch 1 and the same row inside a batch of 3 give the same bits (the launch's MB
    differs, the sum's order does not)."""
    pytest.importorskip("triton")
    dev = kernel_device()
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 256, generator=g).to(dev, dtype)
    w = torch.randn(48, 256, generator=g).to(dev, dtype)
    one = skinny_gemm.skinny_linear(x[1:2], w, config=(1, 4, 64, 4))
    three = skinny_gemm.skinny_linear(x, w, config=(4, 4, 64, 4))
    assert torch.equal(one[0], three[1])


def test_the_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_skinny_gemm.py",
                           "-k", "kernel_matches or does_not_depend or fp8_weights"], 600)
    assert res.returncode == 0 and "21 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_launch_config_follows_the_sweep():
    pytest.importorskip("triton")
    # one row: 4 output rows a program for wide layers, 2 below 5,120; key tiles of 1,024
    assert skinny_gemm.launch_config(1, 5120, 2048) == (1, 4, 1024, 4)
    assert skinny_gemm.launch_config(1, 2048, 4096) == (1, 2, 1024, 4)
    assert skinny_gemm.launch_config(1, 128, 2048) == (1, 2, 1024, 4)
    assert skinny_gemm.launch_config(4, 128, 2048) == (4, 1, 1024, 4)  # the router at 4 rows
    assert skinny_gemm.launch_config(3, 128, 40)[:3] == (4, 1, 64)  # no key tile past what K needs
    # FP8 weights: twice the output rows a program (the same bytes a tile)
    assert skinny_gemm.launch_config(1, 5120, 2048, fp8=True) == (1, 8, 1024, 4)
    assert skinny_gemm.launch_config(1, 4096, 14336, fp8=True) == (1, 4, 1024, 4)


def test_which_products_it_takes(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", skinny_gemm.DEFAULT_MAX_ROWS)
    w = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert not skinny_gemm.applies(torch.zeros(1, 64, dtype=torch.bfloat16), w)  # CPU: torch's
    if not torch.cuda.is_available():
        return
    w = w.cuda()
    x = torch.zeros(skinny_gemm.DEFAULT_MAX_ROWS, 64, dtype=torch.bfloat16, device="cuda")
    assert skinny_gemm.applies(x[:1], w) and skinny_gemm.applies(x, w)  # a small weight: up to 4 rows
    assert not skinny_gemm.applies(torch.zeros(skinny_gemm.DEFAULT_MAX_ROWS + 1, 64, dtype=torch.bfloat16,
                                               device="cuda"), w)
    big = torch.zeros(2048, 1024, dtype=torch.bfloat16, device="cuda")  # past SMALL_WEIGHT
    xb = torch.zeros(2, 1024, dtype=torch.bfloat16, device="cuda")
    assert skinny_gemm.applies(xb[:1], big) and not skinny_gemm.applies(xb, big)
    assert not skinny_gemm.applies(x.float(), w.float())
    odd = torch.zeros(16, 60, dtype=torch.bfloat16, device="cuda")
    assert not skinny_gemm.applies(x[:1, :60], odd)  # K not a multiple of 8
    monkeypatch.setattr(skinny_gemm, "MAX_ROWS", 0)  # PAGEDLLM_SKINNY_MAX_ROWS=0
    assert not skinny_gemm.applies(x[:1], w)


def test_which_fp8_products_it_takes(monkeypatch):
    """FP8: a CUDA bf16/fp16 input of up to FP8_MAX_ROWS rows, an e4m3 weight with one scale
    a row, K a multiple of 16; nothing on the CPU."""
    pytest.importorskip("triton")
    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 1)
    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    s = torch.ones(32, 1)
    assert not skinny_gemm.applies_fp8(torch.zeros(1, 64, dtype=torch.bfloat16), w, s)  # CPU
    if not torch.cuda.is_available():
        return
    w, s = w.cuda(), s.cuda()
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda")
    assert skinny_gemm.applies_fp8(x[:1], w, s) and not skinny_gemm.applies_fp8(x, w, s)
    assert skinny_gemm.applies_fp8(x[:1].half(), w, s) and not skinny_gemm.applies_fp8(x[:1].float(), w, s)
    assert not skinny_gemm.applies_fp8(x[:1], w, torch.ones(32, 2, device="cuda"))  # block scales
    assert not skinny_gemm.applies_fp8(x[:1], w.to(torch.bfloat16), s)  # not an fp8 weight
    assert not skinny_gemm.applies_fp8(x[:1, :56], torch.zeros(32, 56, dtype=torch.float8_e4m3fn,
                                                               device="cuda"), s)  # K not a multiple of 16
    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 2)
    assert skinny_gemm.applies_fp8(x, w, s)
    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 0)  # PAGEDLLM_SKINNY_FP8_MAX_ROWS=0
    assert not skinny_gemm.applies_fp8(x[:1], w, s)


@pytest.mark.gpu
def test_dense_layers_take_it_at_decode_and_match_cublas():
    """A linear layer at one row goes through the kernel (bf16, CUDA) and agrees with
    F.linear; at 64 rows it is F.linear's own result."""
    from pagedllm.model_executor.layers.linear import ReplicatedLinear

    torch.manual_seed(0)
    layer = ReplicatedLinear(2048, 5120, bias=True).to("cuda", torch.bfloat16)
    layer.weight.data.normal_(0, 0.02)
    layer.bias.data.normal_(0, 0.02)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    assert skinny_gemm.applies(x, layer.weight)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(x).float(), ref, rtol=2e-2, atol=2e-2)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
