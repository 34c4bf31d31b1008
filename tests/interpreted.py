"""Code run in Triton's interpreter from a CPU test. TRITON_INTERPRET, and the pagedllm
switches read when a module is imported (PAGEDLLM_DECODE_KV_SPLITS), take effect only in
a fresh process, so these tests start one; CI's machine has no GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(args: list[str], timeout: int, **env: str | None) -> subprocess.CompletedProcess:
    """`python *args` in the repository root with TRITON_INTERPRET=1, the repository on the
    path and `env` over the current environment (None: the variable unset)."""
    full = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def kernel_device() -> str:
    """Where a Triton kernel test runs: "cuda", else "cpu" inside Triton's interpreter
    (TRITON_INTERPRET=1, as run_interpreted starts it); otherwise the test is skipped."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs CUDA or Triton's interpreter")
