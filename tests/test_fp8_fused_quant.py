"""Activations quantized per token by the kernel that makes them (RMSNorm, SiLU-and-mul)
for the FP8 layer after it, against the two-step path they replace (the plain kernel, then
the token quantizer): the same e4m3 bytes and scales. On CUDA, or in Triton's interpreter
from a fresh process (whose e4m3 casts round differently from CUDA's, so there the fused
kernels are held to the interpreted quantizer, and to torch's scales exactly); the CUDA
tests also hold them to torch's quantization and run a whole FP8 model both ways."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted

pytest.importorskip("triton")

from pagedllm.model_executor.layers import fused_ops  # noqa: E402
from pagedllm.model_executor.layers.quantization import fp8 as fp8_method  # noqa: E402
from pagedllm.model_executor.layers.quantization import fp8_quant_kernel  # noqa: E402
from pagedllm.model_executor.layers.quantization.fp8_rows import Fp8Rows  # noqa: E402


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs CUDA or Triton's interpreter")


def _dtype(dev: str) -> torch.dtype:
    return torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's bf16 math is not CUDA's


def _same(fused: Fp8Rows, q: torch.Tensor, s: torch.Tensor) -> None:
    assert fused.q.dtype == torch.float8_e4m3fn and fused.scale.dtype == torch.float32
    assert fused.scale.shape == s.shape and torch.equal(fused.scale, s)
    assert torch.equal(fused.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("n,rows", [(64, 9), (100, 3), (4096, 5)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gemma", [False, True])
def test_norm_quant_equals_norm_then_quant(n, rows, residual, gemma):
    dev = _device()
    dtype = _dtype(dev)
    g = torch.Generator().manual_seed(n * rows)
    x = (torch.randn(rows, n, generator=g) * 3).to(dev, dtype)
    x[0, : n // 2] = 0
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dev, dtype)
    r1 = torch.randn(rows, n, generator=g).to(dev, dtype) if residual else None
    r2 = r1.clone() if residual else None
    fused = fused_ops.rms_norm(x, w, 1e-6, r1, gemma=gemma, quant=True)
    plain = fused_ops.rms_norm(x, w, 1e-6, r2, gemma=gemma)
    assert isinstance(fused, Fp8Rows) and fused.dtype == dtype and fused.shape == (rows, n)
    _same(fused, *fp8_quant_kernel.quantize_tokens_triton(plain))
    torch.testing.assert_close(fused.scale, fp8_method.quantize_tokens_torch(plain)[1], rtol=0, atol=0)
    if residual:
        assert torch.equal(r1, r2)  # the new residual, written the same way


@pytest.mark.parametrize("n,rows", [(40, 5), (1536, 3), (14336, 2)])
def test_silu_mul_quant_equals_silu_mul_then_quant(n, rows):
    dev = _device()
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(rows, 2 * n, generator=g) * 2).to(dev, _dtype(dev))
    fused = fused_ops.silu_and_mul_quant(x)
    plain = fused_ops.silu_and_mul(x)
    assert fused.shape == (rows, n) and fused.dtype == x.dtype
    _same(fused, *fp8_quant_kernel.quantize_tokens_triton(plain))
    torch.testing.assert_close(fused.scale, fp8_method.quantize_tokens_torch(plain)[1], rtol=0, atol=0)
    assert fused_ops.silu_and_mul_quant(x[:0]).shape == (0, n)


def test_long_rows_loop_over_blocks():
    """Rows longer than WHOLE_ROW take the two-pass loop: same scales, same bytes as the
    one-pass kernel on the same row (and torch's scale)."""
    dev = _device()
    k = fp8_quant_kernel.WHOLE_ROW + 5
    x = (torch.randn(3, k) * 4).to(dev, _dtype(dev))
    q, s = fp8_quant_kernel.quantize_tokens_triton(x)
    torch.testing.assert_close(s, fp8_method.quantize_tokens_torch(x)[1], rtol=0, atol=0)
    head_q, head_s = fp8_quant_kernel.quantize_tokens_triton(x[:, :fp8_quant_kernel.WHOLE_ROW].contiguous())
    rescaled = fp8_quant_kernel.quantize_tokens_triton(torch.cat([x[:, :8], x[:, :8]], 1))[1]
    assert torch.equal(rescaled, fp8_method.quantize_tokens_torch(x[:, :8])[1])
    # where a row's amax lies in its first WHOLE_ROW values, both kernels see one scale
    x[:, -5:] = 0
    q, s = fp8_quant_kernel.quantize_tokens_triton(x)
    head_q, head_s = fp8_quant_kernel.quantize_tokens_triton(x[:, :fp8_quant_kernel.WHOLE_ROW].contiguous())
    assert torch.equal(s, head_s)
    assert torch.equal(q[:, :fp8_quant_kernel.WHOLE_ROW].view(torch.uint8), head_q.view(torch.uint8))


def test_fused_quant_in_the_interpreter():
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fp8_fused_quant.py",
                           "-k", "equals or loop"], 600)
    assert res.returncode == 0 and "16 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_which_layers_take_fp8_rows(monkeypatch):
    """Only an FP8 layer on the tensor-core path with one scale column takes pre-quantized
    rows, and not in the batch-invariant mode or with PAGEDLLM_FP8_FUSED_QUANT=0; a LoRA
    wrapper never does (it reads the float input too)."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from pagedllm import batch_invariant
    from pagedllm.model_executor.layers import skinny_gemm
    from pagedllm.model_executor.layers.quantization.fp8 import Fp8Method
    from pagedllm.model_executor.lora.layers import LoRAMethod

    method = Fp8Method.__new__(Fp8Method)
    method.fp8_matmul, method.k_block = True, 64
    layer = SimpleNamespace(in_features=64)
    assert method.takes_fp8_rows(layer)
    method.k_block = 32  # block scales: the 1x128 recipe quantizes per block, not per token
    assert not method.takes_fp8_rows(layer)
    method.k_block, method.fp8_matmul = 64, False  # dequantized at load
    assert not method.takes_fp8_rows(layer)
    method.fp8_matmul = True
    monkeypatch.setattr(batch_invariant, "is_enabled", lambda: True)
    assert not method.takes_fp8_rows(layer)
    monkeypatch.setattr(batch_invariant, "is_enabled", lambda: False)
    monkeypatch.setattr(fp8_method, "FUSED_QUANT", False)
    assert not method.takes_fp8_rows(layer)
    monkeypatch.setattr(fp8_method, "FUSED_QUANT", True)
    lora = LoRAMethod.__new__(LoRAMethod)
    lora.inner = method
    assert method.takes_fp8_rows(layer) and not lora.takes_fp8_rows(layer)
    # where the few-row kernel takes a layer (weight-only, reading the float input), inputs
    # of up to FP8_MAX_ROWS rows stay float; larger ones, or of unknown size, are quantized
    method.skinny = True
    monkeypatch.setattr(skinny_gemm, "FP8_MAX_ROWS", 2)
    assert not method.takes_fp8_rows(layer, 1) and not method.takes_fp8_rows(layer, 2)
    assert method.takes_fp8_rows(layer, 3) and method.takes_fp8_rows(layer)
    method.skinny = False
    assert method.takes_fp8_rows(layer, 1)
    code = "from pagedllm.model_executor.layers.quantization import fp8; print(fp8.FUSED_QUANT)"
    for value, want in (("0", "False"), ("1", "True"), (None, "True")):
        env = {k: v for k, v in os.environ.items() if k != "PAGEDLLM_FP8_FUSED_QUANT"}
        if value is not None:
            env["PAGEDLLM_FP8_FUSED_QUANT"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == want, out.stderr[-2000:]


# ---------------------------------------------------------------------------- CUDA
def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
def test_fused_quant_equals_torch_quantization_on_cuda():
    """On CUDA the fused kernels' bytes are torch's per-token quantization of the plain
    kernels' output."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(300, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 2
    _same(fused_ops.silu_and_mul_quant(x), *fp8_method.quantize_tokens_torch(fused_ops.silu_and_mul(x)))
    h = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    _same(fused_ops.rms_norm(h, w, 1e-5, quant=True), *fp8_method.quantize_tokens_torch(fused_ops.rms_norm(h, w, 1e-5)))


@pytest.mark.gpu
def test_fp8_model_fused_and_unfused_agree(tmp_path, monkeypatch):
    """A whole FP8 model (compressed-tensors, per-channel) on CUDA, eager: the norms and
    SiLU-and-mul hand the FP8 layers e4m3 rows (counted), and its greedy tokens and
    logprobs equal those of the run where every layer quantizes its own input."""
    if not _fp8_gpu():
        pytest.skip("needs compute capability 8.9 or newer")
    from hf_models import save_tiny_model
    from quant_packers import FP8Spec, prompts, write_fp8_checkpoint

    from pagedllm import LLM, SamplingParams
    from pagedllm.model_executor.layers.quantization.fp8 import Fp8Method

    hf = save_tiny_model(str(tmp_path / "float"), "llama", hidden_size=128, intermediate_size=256)
    write_fp8_checkpoint(hf, str(tmp_path / "fp8"), FP8Spec("compressed-tensors", "channel"))
    calls = {"norm": 0, "silu": 0}
    norm, silu = fused_ops.rms_norm, fused_ops.silu_and_mul_quant

    def counted_norm(*a, quant=False, **k):
        calls["norm"] += quant
        return norm(*a, quant=quant, **k)

    def counted_silu(x):
        calls["silu"] += 1
        return silu(x)

    monkeypatch.setattr(fused_ops, "rms_norm", counted_norm)
    monkeypatch.setattr(fused_ops, "silu_and_mul_quant", counted_silu)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    reqs = [{"prompt_token_ids": p} for p in prompts(3, seed=7)]

    def run():
        llm = LLM(model=str(tmp_path / "fp8"), device="cuda", dtype="bfloat16", skip_tokenizer_init=True,
                  num_kv_blocks=64, enforce_eager=True)
        outs = llm.generate(reqs, params)
        del llm
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids, strict=True)])
                for o in outs]

    fused = run()
    assert calls["norm"] > 0 and calls["silu"] > 0
    monkeypatch.setattr(Fp8Method, "takes_fp8_rows", lambda self, layer, rows=None: False)
    seen = dict(calls)
    plain = run()
    assert calls == seen  # nothing quantized ahead this time
    assert [t for t, _ in fused] == [t for t, _ in plain]
    for (_, a), (_, b) in zip(fused, plain, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)
