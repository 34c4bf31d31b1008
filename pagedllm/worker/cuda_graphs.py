"""CUDA graphs for decode steps: one captured forward (+ logits) per batch size.

A decode step of a small model is hundreds of tiny kernel launches whose Python and
launch overhead exceeds the GPU work; replaying a graph issues them all at once. Inputs
live in one persistent int32 device buffer (token ids, positions, slots, context lengths,
block tables) that a single host-to-device copy refreshes before each replay. A batch is
padded up to the nearest captured size; padding rows write no KV (slot -1) and attend to
one key of block 0, and their logits are ignored.

With LoRA the graphs hold the adapter kernels too: they read each row's slot from the
LoRABatch's persistent buffer, refreshed before each replay (padding rows use none).

Steps that verify speculative drafts have their own graphs (VerifyGraphs): every
sequence takes k + 1 rows, its last token and up to k drafts, right-aligned so that the
rows of a sequence with fewer drafts are padding in front of its real ones. Steps that
carry decodes and capped prompt chunks have theirs too (MixedGraphs; PAGEDLLM_MIXED_GRAPHS=0: eager).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, long_decode
from pagedllm.config import env_flag

logger = logging.getLogger(__name__)


# PAGEDLLM_GRAPH_TABLE_UPLOAD=compact: block tables go to the graphs' inputs compacted to a
# step's columns (_GraphInputs.upload). Off ("full", every column) until a GPU run has
# checked and timed it: it was built and tested on the CPU only.
COMPACT_TABLES = os.environ.get("PAGEDLLM_GRAPH_TABLE_UPLOAD", "full") == "compact"


def max_graph_batch() -> int:
    """Decode steps of up to this many sequences replay graphs; larger ones run eagerly.
    PAGEDLLM_MAX_GRAPH_BATCH (default 512) sets it; the runner also stops at max_num_seqs.
    The sizes share one logits buffer (SharedOutput) and one memory pool, so the sizes
    over 256 cost start-up time (16 more graphs), not memory. On an H100, trt-8b-2k (512
    sequences, FP8) ran 16,312 output tok/s capturing up to 512 against 12,797 up to 256:
    at 257-512 sequences the eager launches were not hidden behind the device's work
    (benchmarks/results/2026-12-07-gpu-h100-trt-8b-2k-g*.json)."""
    raw = os.environ.get("PAGEDLLM_MAX_GRAPH_BATCH", "512")
    if not raw.strip().isdigit() or not 1 <= int(raw) <= 1024:
        raise ValueError(f"PAGEDLLM_MAX_GRAPH_BATCH={raw!r}: expected an integer from 1 to 1024")
    return int(raw)


def mixed_graph_chunks(prefill_cap: int | None, paced: bool = False) -> list[int]:
    """The prompt rows MixedGraphs capture under a cap on a step's prompt tokens beside
    decodes (a quarter, a half and all of it; `paced`, with --prefill-step-ratio, also an
    eighth), or none: not made for no cap or one over 2,048 (such chunks keep the device
    busy past the launches' host cost), nor with PAGEDLLM_MIXED_GRAPHS=0. On an H100
    (gpu-7b's shape, 64 streams, a 32k prompt read in chunks of 512) they cut the streams'
    p99 gap while the prompt prefills from 95.8 to 48.8 ms.

    The eighth is the paced chunks' floor: the pacer asks for the largest bucket whose cost
    fits its budget, else the smallest. On an H100 late in a 32k prompt the 128-row bucket
    added 15 ms to an 11.7 ms step against a budget of 5.8 ms at ratio 1.5
    (benchmarks/results/2026-12-07-gpu-h100-pacer-mixed-ratio*.jsonl). Its attention is
    two 64-query tiles per head, each reading the prompt's keys. 64 rows are one tile and
    half the products."""
    if not env_flag("PAGEDLLM_MIXED_GRAPHS", default=True):
        return []
    if not prefill_cap or prefill_cap > 2048:
        return []
    sizes = {max(16, prefill_cap // 4), max(16, prefill_cap // 2), prefill_cap}
    if paced:
        sizes.add(max(16, prefill_cap // 8))
    return sorted(sizes)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class _GraphInputs:
    """The graphs' inputs: named int32 fields of one persistent device buffer, each 64-byte
    aligned so every captured size uses the same kernel specialisation, refreshed by one
    copy from one of two pinned host buffers. The two are used in turn: with async
    scheduling the next step is laid out while the previous copy may still be queued, so a
    buffer is only rewritten once the event recorded after its own copy has passed."""

    def __init__(self, lengths: dict[str, int], device: torch.device, table_width: int | None = None):
        """`table_width`: the block tables' row width, where a "tables" field holds them
        (it is laid out last): upload(table_cols) then copies only the columns a step uses."""
        self._off: dict[str, int] = {}
        n = 0
        for name, length in sorted(lengths.items(), key=lambda kv: kv[0] == "tables"):
            self._off[name] = n
            n += -(-length // 16) * 16
        pinned = device.type == "cuda"  # (the CPU runs them only in the layout tests)
        self._hosts = [torch.zeros(n, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.dev = torch.zeros(n, dtype=torch.int32, device=device)
        # the staging buffers (16 MB on the device and twice that pinned, at 512 rows of a
        # 128k context) only where the compacted upload is on
        self._width = table_width if "tables" in lengths and COMPACT_TABLES else None
        if self._width:
            self._table_rows = lengths["tables"] // self._width
            size = self._table_rows * self._width
            self._stages = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
            self._stage_dev = torch.zeros(size, dtype=torch.int32, device=device)

    def field(self, name: str, size: int, buf: torch.Tensor | np.ndarray | None = None):
        buf = self.dev if buf is None else buf
        start = self._off[name]
        return buf[start : start + size]

    def hosts(self) -> list[np.ndarray]:
        return [h.numpy() for h in self._hosts]

    def next_host(self) -> np.ndarray:
        """The host buffer to lay out the next step in (once its last copy has passed)."""
        self._turn ^= 1
        if self._copied[self._turn] is not None:
            self._copied[self._turn].synchronize()
        return self._hosts[self._turn].numpy()

    def upload(self, table_cols: int | None = None) -> None:
        """Copy the buffer just laid out to the device, behind the queued work. With
        `table_cols`, the block tables' first columns alone (every row: a padding row
        reads its first entry): each row is as wide as the longest context the graphs
        allow (8,192 entries at 128k tokens of 16), and the whole of them, 16 MB at 512
        rows, would cross the bus every step ahead of the replay; the columns go over
        compacted and are spread into place on the device."""
        host, t0 = self._hosts[self._turn], self._off.get("tables")
        if not self._width or table_cols is None or table_cols >= self._width:
            self.dev.copy_(host, non_blocking=True)
        else:
            rows, w, c = self._table_rows, self._width, max(1, table_cols)
            self.dev[:t0].copy_(host[:t0], non_blocking=True)
            stage = self._stages[self._turn][: rows * c]
            stage.numpy().reshape(rows, c)[:] = host[t0 : t0 + rows * w].numpy().reshape(rows, w)[:, :c]
            dev_stage = self._stage_dev[: rows * c]
            dev_stage.copy_(stage, non_blocking=True)
            self.dev[t0 : t0 + rows * w].view(rows, w)[:, :c].copy_(dev_stage.view(rows, c))
        if self.dev.is_cuda:
            done = self._copied[self._turn] = self._copied[self._turn] or torch.cuda.Event()
            done.record()


class SharedOutput:
    """One output buffer for a set of graphs: each graph copies its logits into the first
    rows. A graph's own output stays allocated as long as the graph may be replayed, so
    without it every captured size would keep its rows x vocabulary alive (some 2 GB over
    the sizes up to 512 at a 128k vocabulary, taken from the page pool); with it the sizes
    keep one buffer of the largest. The price is one device copy of the step's logits
    inside each replay (rows x vocabulary: 0.5 MB at one row of a 128k vocabulary, 128 MB at
    512 rows; by bandwidth a few microseconds to about 0.1 ms, not yet timed on a GPU). The
    first (largest) warm-up run sizes it."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def keep(self, out: torch.Tensor) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty_like(out)
        elif self.buf.shape[0] < out.shape[0]:  # earlier graphs already write into this one
            raise RuntimeError("graphs sharing an output must be captured largest first")
        return self.buf[: out.shape[0]].copy_(out)


def _capture(sizes: list, device: torch.device, forward: Callable[..., torch.Tensor],
             before: Callable[..., None] | None = None, pool=None,
             shared: SharedOutput | None = None) -> tuple[dict, dict]:
    """One graph of `forward(size)` per size, largest first so that the smaller ones reuse
    its memory pool (or `pool`, another set's); each size runs twice outside the capture to
    compile its kernels and settle allocations. The outputs go into `shared` (a new one if
    None: see SharedOutput)."""
    shared = SharedOutput() if shared is None else shared
    graphs: dict = {}
    outputs: dict = {}
    for size in reversed(sizes):
        if before is not None:
            before(size)
        for _ in range(2):
            shared.keep(forward(size))
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outputs[size] = shared.keep(forward(size))
        pool = g.pool()
        graphs[size] = g
    torch.cuda.synchronize(device)
    return graphs, outputs


class _StepGraphs:
    """What decode and verify graphs share: the captured batch sizes, the block tables in
    their inputs, and which captured size a step fits."""

    inputs: _GraphInputs

    def __init__(self, max_batch: int, max_blocks: int):
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = max_blocks

    def _tables(self, buf=None):
        return self.inputs.field("tables", self.max_batch * self.width, buf).reshape(self.max_batch, self.width)

    def _pad_decodes(self, h: np.ndarray, start: int, stop: int) -> None:
        """Decode rows (and their sequences) [start, stop) as padding: token 0 at position
        0, no KV written, one key seen."""
        for name, value in (("ids", 0), ("pos", 0), ("slots", -1), ("ctx", 1)):
            self.inputs.field(name, stop, h)[start:] = value

    def _size_for(self, num_seqs: int, tables: np.ndarray) -> int | None:
        """The smallest captured size holding `num_seqs` sequences; None if none does or
        the block tables are wider than captured."""
        if num_seqs > self.max_batch or tables.shape[1] > self.width:
            return None
        return next(s for s in self.sizes if s >= num_seqs)


class DecodeGraphs(_StepGraphs):
    """Decode steps, one graph per batch size; with `long_variants` a second set whose
    attention splits every sequence's keys (AttentionMetadata.decode_long), replayed for
    batches with one long context among short ones (attention.long_decode), where the
    first set would wait on that sequence's keys read by one program a head."""

    def __init__(self, model, kv_caches, device: torch.device, max_batch: int, max_blocks: int,
                 lora=None, long_variants: bool = False):
        super().__init__(max_batch, max_blocks)
        self.lora = lora  # a LoRABatch, or None
        b, w = self.max_batch, self.width
        self.inputs = _GraphInputs({"ids": b, "pos": b, "slots": b, "q_start": b, "q_len": b,
                                    "ctx": b, "tables": b * w}, device, w)
        for h in self.inputs.hosts():
            self.inputs.field("q_start", b, h)[:] = np.arange(b)
            self.inputs.field("q_len", b, h)[:] = 1
            self._pad_decodes(h, 0, b)
        self.inputs.upload()

        def before(size: int) -> None:
            if lora is not None:  # captured with the adapter kernels in (no row uses one yet)
                lora.bind(size)
                lora.active = True

        def forward(size: int, long: bool = False) -> torch.Tensor:
            ids, pos = self.inputs.field("ids", size), self.inputs.field("pos", size)
            return model.compute_logits(model(ids, pos, kv_caches, self._meta(size, long)))

        shared = SharedOutput()
        self.graphs, self.logits = _capture(self.sizes, device, forward, before, shared=shared)
        self.long_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.long_logits: dict[int, torch.Tensor] = {}
        if long_variants:
            # Into the first set's logits buffer: the two sets never run at once.
            def forward_long(size: int) -> torch.Tensor:
                return forward(size, True)

            try:
                self.long_graphs, self.long_logits = _capture(
                    self.sizes, device, forward_long, before, pool=self.graphs[self.sizes[0]].pool(),
                    shared=shared)
            except Exception:  # the first set serves every step; such batches run unsplit
                logger.warning("decode graphs for a long context among short ones were not captured; "
                               "such steps replay the ordinary decode graphs", exc_info=True)
        self.long_replays = 0  # steps the long set served (the tests check that some were)
        self.replays = 0  # steps either set served (benchmarks tell replayed steps from eager ones)
        # a list (set by a benchmark) collects (start, end) CUDA events around each replay:
        # the device's own time per step, apart from the host's
        self.timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        if lora is not None:
            lora.active = False

    def _meta(self, size: int, long: bool = False) -> AttentionMetadata:
        f = self.inputs.field
        return AttentionMetadata(
            slot_mapping=f("slots", size), num_decode=size,
            block_tables=self._tables()[:size], q_start=f("q_start", size),
            q_len=f("q_len", size), ctx_len=f("ctx", size), decode_long=long,
        )

    def run(self, arrays: dict[str, np.ndarray],
            before_replay: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Replay the graph for a decode-only step; None if it does not fit one.
        `before_replay` may still change the input ids on the device (tokens that the
        previous step sampled and the host has not read yet)."""
        n = len(arrays["ids"])
        tables = arrays["tables"]
        size = self._size_for(n, tables)
        if size is None:
            return None
        h = self.inputs.next_host()
        for name, key in (("ids", "ids"), ("pos", "positions"), ("slots", "slots"), ("ctx", "ctx_len")):
            self.inputs.field(name, n, h)[:] = arrays[key]
        self._pad_decodes(h, n, self.max_batch)
        self._tables(h)[:n, : tables.shape[1]] = tables
        self.inputs.upload(tables.shape[1])
        if before_replay is not None:
            before_replay(self.inputs.field("ids", n))
        if self.lora is not None:
            self.lora.set(arrays["lora_slots"], size)
        self.replays += 1
        long = bool(self.long_graphs) and long_decode(arrays["ctx_len"])
        if self.timing is not None:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.timing.append(events)
            events[0].record()
        if long:
            self.long_replays += 1
            self.long_graphs[size].replay()
        else:
            self.graphs[size].replay()
        if self.timing is not None:
            self.timing[-1][1].record()
        return (self.long_logits if long else self.logits)[size][:n]


class VerifyGraphs(_StepGraphs):
    """Graphs of the steps that verify speculative drafts (the batch gate keeps them to at
    most `max_batch` sequences). Sequence i owns rows [i * q, (i + 1) * q), q = k + 1; its
    m real rows (the last sampled token and m - 1 drafts) are the last m, and the rows in
    front are padding: they write no KV (slot -1) and, sitting at earlier positions,
    attend only to keys already cached (none before position 0), so the real rows see
    exactly what they would eagerly. The launch is the prefill kernel's, over tiles fixed
    per size. After a replay the logits are gathered back into the step's row order."""

    def __init__(self, model, kv_caches, device: torch.device, max_batch: int, max_blocks: int,
                 rows_per_seq: int, tile_q: int):
        super().__init__(max_batch, max_blocks)
        b, w = self.max_batch, self.width
        self.q = q = rows_per_seq
        self.inputs = _GraphInputs({"ids": b * q, "pos": b * q, "slots": b * q, "rows": b * q,
                                    "q_start": b, "q_len": b, "ctx": b, "tables": b * w}, device, w)
        for h in self.inputs.hosts():
            self.inputs.field("q_start", b, h)[:] = np.arange(b) * q
            self.inputs.field("q_len", b, h)[:] = q
            self._reset(h, 0)
        self.inputs.upload()
        # The prefill tiles of a size-s batch are the first s * per_seq of the largest's.
        self.tiles_per_seq = per_seq = -(-q // tile_q)
        tiles = np.stack([np.repeat(np.arange(b), per_seq), np.tile(np.arange(per_seq) * tile_q, b)])
        self.tiles = torch.as_tensor(tiles, dtype=torch.int32, device=device)
        self.tile_q = tile_q

        def forward(size: int) -> torch.Tensor:
            rows = size * q
            ids, pos = self.inputs.field("ids", rows), self.inputs.field("pos", rows)
            return model.compute_logits(model(ids, pos, kv_caches, self._meta(size)))

        self.graphs, self.logits = _capture(self.sizes, device, forward)
        self.replays = 0  # steps served by a replay (the tests check that some were)

    def _meta(self, size: int) -> AttentionMetadata:
        f, rows, nt = self.inputs.field, size * self.q, size * self.tiles_per_seq
        return AttentionMetadata(
            slot_mapping=f("slots", rows), num_decode=0, block_tables=self._tables()[:size],
            q_start=f("q_start", size), q_len=f("q_len", size), ctx_len=f("ctx", size),
            prefill_tiles=self.tiles[:, :nt], num_prefill_tiles=nt, prefill_tile_q=self.tile_q,
        )

    def _reset(self, h: np.ndarray, start_seq: int) -> None:
        """Every row padding (from `start_seq` on): token 0 at position 0, no KV written;
        the padding sequences see one key of block 0."""
        b, q = self.max_batch, self.q
        for name, value in (("ids", 0), ("pos", 0), ("slots", -1)):
            self.inputs.field(name, b * q, h)[start_seq * q :] = value
        self.inputs.field("ctx", b, h)[start_seq:] = 1

    def run(self, arrays: dict[str, np.ndarray]) -> torch.Tensor | None:
        """Replay for a step whose sequences each compute their last token and at most
        q - 1 drafts (no prompt rows); the logits of its rows, in the step's order. None
        if the step does not fit."""
        lens = arrays["q_len"]
        n = len(lens)
        tables = arrays["tables"]
        size = self._size_for(n, tables)
        if size is None or int(lens.max()) > self.q or "fill" in arrays:
            return None
        total = int(lens.sum())
        # Row j of sequence i goes to i * q + (q - len_i) + j.
        dst = np.repeat(np.arange(n) * self.q + self.q - lens, lens) + (
            np.arange(total) - np.repeat(arrays["q_start"], lens))
        h = self.inputs.next_host()
        self._reset(h, 0)
        for name, key in (("ids", "ids"), ("pos", "positions"), ("slots", "slots")):
            self.inputs.field(name, self.max_batch * self.q, h)[dst] = arrays[key]
        self.inputs.field("rows", total, h)[:] = dst
        self.inputs.field("ctx", n, h)[:] = arrays["ctx_len"]
        self._tables(h)[:n, : tables.shape[1]] = tables
        self.inputs.upload(tables.shape[1])
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size].index_select(0, self.inputs.field("rows", total))


class MixedGraphs(_StepGraphs):
    """Graphs of the steps that carry decodes and a few rows of prompt (a long prompt read
    in capped chunks beside running streams). Eagerly such a step costs the host one launch
    per kernel for the whole model, so with a CUDA-graph decode step beside it every chunk
    stalls the streams well past the chunk's own device time.

    A graph is captured per (decode size b, chunk rows c): rows [0, b) are decodes laid out
    as in DecodeGraphs; rows [b, b + c) are up to `max_prompts` prompt chunks packed in
    order (sequences b .. b + max_prompts - 1) and then padding rows, which form one more
    sequence of their own (no KV written, positions from 0, finite garbage outputs). The
    prefill kernel runs over a fixed number of tiles: enough for any split of c rows over
    those sequences, the spare ones pointing past the padding sequence's last query, where
    every row is masked. Logits are computed for the b decode rows and the last row of
    each prompt slot only, into one buffer all the graphs share."""

    def __init__(self, model, kv_caches, device: torch.device, max_batch: int, max_blocks: int,
                 chunk_sizes: list[int], tile_q: int, max_prompts: int = 4):
        super().__init__(max_batch, max_blocks)
        self.chunks = sorted(chunk_sizes)
        self.p = p = max_prompts
        self.tile_q = tile_q
        b, c, w = self.max_batch, self.chunks[-1], self.width
        seqs = b + p + 1  # decodes, prompt slots, the padding sequence
        self.max_tiles = -(-c // tile_q) + p + 1
        self.inputs = _GraphInputs({"ids": b + c, "pos": b + c, "slots": b + c, "q_start": seqs,
                                    "q_len": seqs, "ctx": seqs, "tables": seqs * w,
                                    "tiles": 2 * self.max_tiles, "sample": b + p,
                                    "gather": b + p}, device, w)
        for h in self.inputs.hosts():  # nothing a warm-up run does writes a page
            self.inputs.field("slots", b + c, h)[:] = -1
            self.inputs.field("ctx", seqs, h)[:] = 1
        self.out = SharedOutput()  # [b + p, vocab], shared by every graph
        self.replays = 0  # steps served by a replay (the tests check that some were)

        def forward(key: tuple[int, int]) -> torch.Tensor:
            size, rows = key
            f = self.inputs.field
            hidden = model(f("ids", size + rows), f("pos", size + rows), kv_caches, self._meta(size, rows))
            return model.compute_logits(hidden.index_select(0, f("sample", size + p)))

        def before(key: tuple[int, int]) -> None:  # every row padding, laid out for this graph
            size, rows = key
            h, f = self.inputs.next_host(), self.inputs.field
            self._pad_decodes(h, 0, size)
            f("q_start", size, h)[:], f("q_len", size, h)[:] = np.arange(size), 1
            f("sample", size + p, h)[:] = 0
            self._layout_padding(h, size, rows, 0, [])
            self.inputs.upload()

        keys = sorted(((s, r) for s in self.sizes for r in self.chunks), key=lambda k: (k[0] + k[1], k))
        self.graphs, _ = _capture(keys, device, forward, before, shared=self.out)

    def _tiles(self, rows: int) -> int:
        return -(-rows // self.tile_q) + self.p + 1

    def _tables(self, buf=None):
        seqs = self.max_batch + self.p + 1
        return self.inputs.field("tables", seqs * self.width, buf).reshape(seqs, self.width)

    def _meta(self, size: int, rows: int) -> AttentionMetadata:
        f, seqs, nt = self.inputs.field, size + self.p + 1, self._tiles(rows)
        tiles = f("tiles", 2 * self.max_tiles).view(2, self.max_tiles)
        return AttentionMetadata(
            slot_mapping=f("slots", size + rows), num_decode=size, block_tables=self._tables()[:seqs],
            q_start=f("q_start", seqs), q_len=f("q_len", seqs), ctx_len=f("ctx", seqs),
            prefill_tiles=tiles[:, :nt], num_prefill_tiles=nt, prefill_tile_q=self.tile_q,
            prefill_busy_tiles=-(-rows // self.tile_q),  # the spare tiles return at once
        )

    def _layout_padding(self, h: np.ndarray, size: int, rows: int, real: int, prompt_lens: list[int]) -> None:
        """Everything of graph (size, rows) but the real rows: padding decodes (token 0 at
        position 0, no KV, one key), empty prompt slots, the padding sequence over rows
        [size + real, size + rows), and the tiles of the prompt chunks and of the padding."""
        f, p, tq = self.inputs.field, self.p, self.tile_q
        seqs = size + p + 1
        q_start, q_len, ctx = f("q_start", seqs, h), f("q_len", seqs, h), f("ctx", seqs, h)
        pad = rows - real
        # the padding sequence: rows [size + real, size + rows), positions 0 .. pad - 1
        f("ids", size + rows, h)[size + real :] = 0
        f("pos", size + rows, h)[size + real :] = np.arange(pad)
        f("slots", size + rows, h)[size + real :] = -1
        q_start[size + p], q_len[size + p], ctx[size + p] = size + real, pad, max(pad, 1)
        # empty prompt slots
        n = len(prompt_lens)
        q_start[size + n : size + p], q_len[size + n : size + p], ctx[size + n : size + p] = size + rows, 0, 1
        # tiles: each prompt chunk's, the padding's, then spare ones past the padding's queries
        seq_ids = [size + j for j, ln in enumerate(prompt_lens) for _ in range(-(-ln // tq))]
        firsts = [k * tq for ln in prompt_lens for k in range(-(-ln // tq))]
        seq_ids += [size + p] * -(-pad // tq)
        firsts += [k * tq for k in range(-(-pad // tq))]
        spare = self._tiles(rows) - len(seq_ids)
        tiles = f("tiles", 2 * self.max_tiles, h).reshape(2, self.max_tiles)
        tiles[0, : len(seq_ids) + spare] = seq_ids + [size + p] * spare
        tiles[1, : len(seq_ids) + spare] = firsts + [max(pad, 1) + tq] * spare

    def run(self, arrays: dict[str, np.ndarray], num_decode: int, sample_rows: list[int],
            before_replay: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Replay for a step of `num_decode` decodes followed by prompt chunks; the logits of
        `sample_rows` (rows of the step's layout: decodes, then each chunk's last row), in
        that order. None if the step does not fit a graph."""
        lens = arrays["q_len"]
        n_prompts = len(lens) - num_decode
        real = int(lens[num_decode:].sum())
        tables = arrays["tables"]
        size = self._size_for(num_decode, tables)
        if size is None or not 0 < n_prompts <= self.p or real > self.chunks[-1] or "lora_slots" in arrays:
            return None
        rows = next(r for r in self.chunks if r >= real)
        p, nd = self.p, num_decode
        h = self.inputs.next_host()
        f = self.inputs.field
        seqs = size + p + 1
        ids, pos, slots = f("ids", size + rows, h), f("pos", size + rows, h), f("slots", size + rows, h)
        q_start, q_len, ctx = f("q_start", seqs, h), f("q_len", seqs, h), f("ctx", seqs, h)
        # decodes: the step's first nd rows and sequences, then padding decodes
        for name, dst in (("ids", ids), ("positions", pos), ("slots", slots)):
            dst[:nd] = arrays[name][:nd]
            dst[size : size + real] = arrays[name][nd:]
        self._pad_decodes(h, nd, size)
        q_start[:size], q_len[:size] = np.arange(size), 1
        ctx[:nd] = arrays["ctx_len"][:nd]
        prompt_lens = lens[num_decode:].tolist()
        q_start[size : size + n_prompts] = arrays["q_start"][nd:] - nd + size
        q_len[size : size + n_prompts] = lens[nd:]
        ctx[size : size + n_prompts] = arrays["ctx_len"][nd:]
        table = self._tables(h)
        table[:nd, : tables.shape[1]] = tables[:nd]
        table[size : size + n_prompts, : tables.shape[1]] = tables[nd:]
        self._layout_padding(h, size, rows, real, prompt_lens)
        # logits rows: every decode row, and each prompt slot's last row
        ends = np.cumsum(lens[nd:])  # each chunk's end among the prompt rows
        sample = f("sample", size + p, h)
        sample[:size] = np.arange(size)
        sample[size : size + n_prompts] = size + ends - 1
        sample[size + n_prompts :] = 0
        # the step's sample rows -> rows of the logits buffer
        step_rows = np.asarray(sample_rows, dtype=np.int64)
        chunk_of = np.searchsorted(ends + nd, step_rows, side="right")
        gather = np.where(step_rows < nd, step_rows, size + chunk_of)
        f("gather", size + p, h)[: len(gather)] = gather
        self.inputs.upload(tables.shape[1])
        if before_replay is not None:
            before_replay(self.inputs.field("ids", nd))
        self.graphs[(size, rows)].replay()
        self.replays += 1
        return self.out.buf.index_select(0, self.inputs.field("gather", len(gather)))
