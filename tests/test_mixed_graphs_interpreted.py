"""The layout test of test_mixed_graphs.py (decodes and prompt chunks replayed from graphs
give the eager tokens) in Triton's interpreter, in a subprocess: TRITON_INTERPRET is read
when Triton is imported, and CI's machine has no GPU. The async-scheduling case, which
also fills the decodes' input tokens on the device."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from pagedllm.worker import cuda_graphs


def test_mixed_layout_interpreted():
    pytest.importorskip("triton")
    res = run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_mixed_graphs.py",
                           "-k", "layout and True"], 900)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]


def test_chunk_sizes_follow_the_cap_and_the_switch(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_MIXED_GRAPHS", raising=False)
    assert cuda_graphs.mixed_graph_chunks(512) == [128, 256, 512]  # on by default
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", "0")
    assert cuda_graphs.mixed_graph_chunks(512) == []
    monkeypatch.setenv("PAGEDLLM_MIXED_GRAPHS", "1")
    assert cuda_graphs.mixed_graph_chunks(512) == [128, 256, 512]
    assert cuda_graphs.mixed_graph_chunks(32) == [16, 32]
    assert cuda_graphs.mixed_graph_chunks(512, paced=True) == [64, 128, 256, 512]  # the pacer's floor
    assert cuda_graphs.mixed_graph_chunks(64, paced=True) == [16, 32, 64]
    assert cuda_graphs.mixed_graph_chunks(0) == []  # no cap: whole-budget chunks
    assert cuda_graphs.mixed_graph_chunks(4096) == []


def test_graph_batch_cap_reads_its_switch(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_MAX_GRAPH_BATCH", raising=False)
    assert cuda_graphs.max_graph_batch() == 512
    monkeypatch.setenv("PAGEDLLM_MAX_GRAPH_BATCH", "256")
    assert cuda_graphs.max_graph_batch() == 256
    assert cuda_graphs.capture_sizes(512)[-3:] == [480, 496, 512]
    for bad in ("0", "2048", "big", "-1"):
        monkeypatch.setenv("PAGEDLLM_MAX_GRAPH_BATCH", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_MAX_GRAPH_BATCH"):
            cuda_graphs.max_graph_batch()


def test_graph_sizes_share_one_output_buffer():
    """Every size's output is a view of the largest's rows (one buffer, not one per size);
    a larger output after the first would leave earlier graphs writing elsewhere: refused."""
    shared = cuda_graphs.SharedOutput()
    big = shared.keep(torch.arange(12.0).reshape(4, 3))
    small = shared.keep(torch.full((2, 3), 7.0))
    assert small.data_ptr() == big.data_ptr() == shared.buf.data_ptr()
    assert shared.buf[:2].eq(7).all() and shared.buf[2:].eq(torch.arange(6.0, 12).reshape(2, 3)).all()
    with pytest.raises(RuntimeError, match="largest first"):
        shared.keep(torch.zeros(5, 3))
