"""The layout test of test_mixed_graphs.py (decodes and prompt chunks replayed from graphs
give the eager tokens) in Triton's interpreter, in a subprocess: TRITON_INTERPRET is read
when Triton is imported, and CI's machine has no GPU. The async-scheduling case, which
also fills the decodes' input tokens on the device."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedllm.worker import cuda_graphs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mixed_layout_interpreted():
    pytest.importorskip("triton")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_mixed_graphs.py", "-k", "layout and True"],
                         cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_chunk_sizes_follow_the_cap_and_the_switch(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_MIXED_GRAPHS", raising=False)
    assert cuda_graphs.mixed_graph_chunks(512) == []  # opt-in
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", "1")
    assert cuda_graphs.mixed_graph_chunks(512) == [128, 256, 512]
    assert cuda_graphs.mixed_graph_chunks(32) == [16, 32]
    assert cuda_graphs.mixed_graph_chunks(0) == []  # no cap: whole-budget chunks
    assert cuda_graphs.mixed_graph_chunks(4096) == []
