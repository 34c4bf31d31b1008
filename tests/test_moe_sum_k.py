"""fused_moe.sum_k, the k expert rows of a token summed by a kernel of its own (off in the
engine until measured: PAGEDLLM_MOE_SUM_K_TOKENS), against torch's sum (on CUDA, or in
Triton's interpreter from a fresh process)."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted

from pagedllm.model_executor.layers import fused_moe


@pytest.mark.parametrize("tokens,k,hidden", [(1, 8, 2048), (3, 2, 100), (5, 1, 64), (2, 6, 300)])
def test_sum_k_matches_torch(tokens, k, hidden):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        dev, dtype = "cuda", torch.bfloat16
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev, dtype = "cpu", torch.float32
    else:
        pytest.skip("needs CUDA or Triton's interpreter")
    g = torch.Generator().manual_seed(tokens * 100 + k)
    rows = torch.randn(tokens, k, hidden, generator=g).to(dev, dtype)
    out = fused_moe.sum_k(rows, max_tokens=64)
    ref = rows.float().sum(1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    many = torch.randn(65, k, hidden, generator=g).to(dev, dtype)
    torch.testing.assert_close(fused_moe.sum_k(many, max_tokens=64), many.sum(1))  # past the kernel's: torch's


def test_sum_k_in_the_interpreter():
    pytest.importorskip("triton")
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_moe_sum_k.py",
                           "-k", "matches"], 300)
    assert res.returncode == 0 and "4 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
