"""The CUDA graphs' input buffer (worker/cuda_graphs.py _GraphInputs) on the CPU: the
block tables are laid out last, and a step's upload with `table_cols` brings the other
fields whole and the tables' first columns only, leaving the device's later columns as
they were (no graph reads past a row's context)."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.worker import cuda_graphs
from pagedllm.worker.cuda_graphs import _GraphInputs


def test_tables_go_last_and_a_step_uploads_only_its_columns(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "COMPACT_TABLES", True)  # PAGEDLLM_GRAPH_TABLE_UPLOAD=compact
    rows, width = 4, 10
    gi = _GraphInputs({"ids": 8, "tables": rows * width, "tail": 5}, torch.device("cpu"), width)
    assert gi._off["tables"] > gi._off["tail"] > gi._off["ids"]

    def tables(buf):
        return gi.field("tables", rows * width, buf).reshape(rows, width)

    h = gi.next_host()
    gi.field("ids", 8, h)[:] = np.arange(8)
    gi.field("tail", 5, h)[:] = 7
    tables(h)[:] = np.arange(rows * width).reshape(rows, width)
    gi.upload()  # whole
    assert torch.equal(gi.dev, gi._hosts[gi._turn])
    before = tables(gi.dev).clone()

    h = gi.next_host()  # the other host buffer: a step three columns wide
    gi.field("ids", 8, h)[:] = 100 + np.arange(8)
    gi.field("tail", 5, h)[:] = 9
    tables(h)[:] = -5  # stale beyond the step's columns: must not reach the device
    tables(h)[:2, :3] = [[1, 2, 3], [4, 5, 6]]
    tables(h)[2:, :3] = 0  # rows outside the step (padding: their first entry is read)
    gi.upload(3)
    assert gi.field("ids", 8).tolist() == list(range(100, 108)) and gi.field("tail", 5).tolist() == [9] * 5
    dev = tables(gi.dev)
    assert dev[:2, :3].tolist() == [[1, 2, 3], [4, 5, 6]] and not dev[2:, :3].any()
    assert torch.equal(dev[:, 3:], before[:, 3:])
    gi.upload(width)  # as wide as the rows: the whole buffer
    assert torch.equal(gi.dev, gi._hosts[gi._turn])


def test_inputs_without_tables_upload_whole():
    gi = _GraphInputs({"ids": 4, "pos": 4}, torch.device("cpu"))
    h = gi.next_host()
    gi.field("pos", 4, h)[:] = 3
    gi.upload(2)  # no tables: the columns mean nothing
    assert gi.field("pos", 4).tolist() == [3] * 4


def test_whole_upload_unless_compact_is_asked_for(monkeypatch):
    """The default (PAGEDLLM_GRAPH_TABLE_UPLOAD unset: full) copies every column."""
    monkeypatch.setattr(cuda_graphs, "COMPACT_TABLES", False)
    gi = _GraphInputs({"ids": 4, "tables": 2 * 8}, torch.device("cpu"), 8)
    h = gi.next_host()
    gi.field("tables", 16, h)[:] = np.arange(16)
    gi.upload(3)
    assert gi.field("tables", 16).tolist() == list(range(16))
    assert not hasattr(gi, "_stage_dev")  # and no staging buffers were made
