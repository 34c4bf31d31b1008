"""The worker's copy of every request's block table, kept across steps and updated by deltas.

The scheduler sends a request's whole table once, in the first chunk after the request is
admitted (or resumed after a preemption), and afterwards only the block ids appended since
its previous chunk (see `ScheduledChunk`). Under tensor parallelism the SchedulerOutput is
pickled to every rank each step, so a decode step costs a few bytes per sequence instead of
its whole table. Every rank applies the same outputs in the same order and so holds the
same tables.

numpy only (no torch): the delta logic is tested against the scheduler with plain property
tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pagedllm.core.scheduler import ScheduledChunk


class BlockTables:
    """One int32 array with a row per request the worker holds (rows are reused once a
    request ends) and the number of blocks in each row.

    Why this shape: `_layout` runs every step for up to 256 sequences. Gathering the step's
    rows is then one numpy fancy-index (`gather`), where building the table from Python
    lists cost a list-to-array conversion per sequence per step; appending a step's new ids
    is one small slice write per request that got any (most decode steps: none). Entries
    past a row's block count are kept 0, as the old freshly zeroed per-step table had them:
    attention may read a padded row up to the step's widest table, and 0 is a block id of
    every pool, also of a pool smaller than the one the row was written for (profiling).
    The array grows (rows and columns) when needed, so no size is fixed up front."""

    def __init__(self, max_blocks_per_seq: int, rows: int = 16):
        self.table = np.zeros((rows, max(max_blocks_per_seq, 1)), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: row 0 first

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    # ------------------------------------------------------------------ deltas
    def update(self, finished_req_ids: Iterable[str], chunks: Iterable[ScheduledChunk]) -> None:
        """Apply one SchedulerOutput: forget finished requests, then take each chunk's
        blocks (a chunk with `full_table` replaces what was kept: the request is new, or
        was preempted and its old blocks were freed)."""
        for rid in finished_req_ids:
            self.remove(rid)
        for c in chunks:
            if c.full_table:
                self.set(c.request_id, c.new_block_ids)
            elif c.new_block_ids:
                self.append(c.request_id, c.new_block_ids)

    def set(self, request_id: str, block_ids: Sequence[int]) -> None:
        row = self.row_of.get(request_id)
        if row is None:
            row = self._take_row()
            self.row_of[request_id] = row
        else:
            self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.append(request_id, block_ids)

    def append(self, request_id: str, block_ids: Sequence[int]) -> None:
        row = self.row_of[request_id]
        n = int(self.num_blocks[row])
        end = n + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        self.table[row, n:end] = block_ids
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return  # finished before it was ever scheduled with blocks
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def clear(self) -> None:
        for rid in list(self.row_of):
            self.remove(rid)

    # ------------------------------------------------------------------ reads
    def rows(self, request_ids: Iterable[str], n: int) -> np.ndarray:
        row_of = self.row_of
        return np.fromiter((row_of[r] for r in request_ids), dtype=np.int64, count=n)

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tables of `rows` as a fresh [len(rows), widest] array (a copy: the step's
        host buffers never alias this persistent state), and each row's block count."""
        counts = self.num_blocks[rows]
        width = int(counts.max()) if len(rows) else 0
        return self.table[rows, :width], counts

    def block_ids(self, request_id: str) -> list[int]:
        row = self.row_of[request_id]
        return self.table[row, : self.num_blocks[row]].tolist()

    # ------------------------------------------------------------------ storage
    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.table.shape[0]
            self._grow(2 * old, self.table.shape[1])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int, cols: int) -> None:
        table = np.zeros((rows, cols), dtype=np.int32)
        old_rows, old_cols = self.table.shape
        table[:old_rows, :old_cols] = self.table
        counts = np.zeros(rows, dtype=np.int64)
        counts[:old_rows] = self.num_blocks
        self.table, self.num_blocks = table, counts
