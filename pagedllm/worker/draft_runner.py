"""Draft-model speculation: a small checkpoint proposes each step's drafts on the worker.

The scheduler reserves the slots (core/draft_proposer.py: it decides per step and request
how many drafts, with the same gates as n-gram) and the target checks the drafts in its
forward pass as it checks n-gram ones (Sampler.verify). What this module adds is where the
draft tokens come from: before the target's forward, the draft model

1. catches up: one forward over every position of the request it has no KV for yet (the
   whole prompt the first time, then usually just the token the last step produced), whose
   last logits give draft 1;
2. chains: k - 1 one-token forwards, each feeding the draft before, for drafts 2..k.

Drafts are the draft model's greedy choices, so the proposal distribution is one-hot and
the target's exact rejection test (accept a draft with the target's probability of it,
else resample from the target without it) keeps the output distribution the target's at
any temperature; at temperature 0 the output is the target's greedy tokens.

The draft's KV pages are its own tensors over the target's block ids: the scheduler's
allocation of 1 + k slots for the verify covers every position the chain writes (the last
known token's and the first k - 1 drafts'), and a request's blocks, prefix-cached ones
included, hold the same draft KV whichever request wrote it (same tokens, same positions).
A request's `draft_computed` is cut back to the verify's start every step, so positions
of rejected drafts are written again before they are read.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.model_executor.loader import load_model
from pagedllm.model_executor.loader.loader import load_hf_config
from pagedllm.model_source import resolve_source
from pagedllm.worker.step_arrays import chunk_arrays, page_pool

if TYPE_CHECKING:
    from pagedllm.config import SpeculativeConfig
    from pagedllm.core.scheduler import ScheduledChunk
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DraftRunner:
    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig):
        self.runner = runner
        cfg = runner.config
        # A random-weight target (benchmarks) gets a random-weight draft of the given shape.
        load_format = "dummy" if cfg.load_format == "dummy" else "auto"
        source = resolve_source(spec.model, load_format, None, cfg.download_dir)
        hf_config = load_hf_config(source)
        if source.kind != "hf" and getattr(hf_config, "sliding_window", None):
            hf_config.sliding_window = None  # as for the target: GGUF configs carry no window
        self.model = load_model(source, hf_config, runner.max_model_len, runner.backend, runner.device,
                                runner.dtype, cfg.seed, None)
        s = self.model.shape
        if s.vocab != runner.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {s.vocab} "
                             f"tokens, the target's has {runner.vocab_size}: a draft model must share "
                             "the target's tokenizer")
        self.shape = s
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self._kv_mmap = None
        logger.info("speculative decoding: draft model %s (%d layers, %.0f M parameters)", spec.model,
                    s.num_layers, sum(p.numel() for p in self.model.parameters()) / 1e6)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.finfo(self.runner.kv_dtype).bits // 8
        return self.runner.block_size * self.model.page_spec.bytes_per_token(self.shape.num_layers, elem)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s, r, spec = self.shape, self.runner, self.model.page_spec
        # the pool tensor itself: the runner swaps its pages with the target's
        self.kv_pool, self._kv_mmap, self.kv_caches = page_pool(spec, s.num_layers, num_blocks, r.block_size,
                                                                r.kv_dtype, r.device, r.backend)

    def release_kv_cache(self) -> None:
        self.kv_pool, self._kv_mmap, self.kv_caches = None, None, []

    # ------------------------------------------------------------------ proposing
    def propose(self, chunks: list[ScheduledChunk]) -> None:
        """Fill each chunk's reserved `draft_token_ids` (placeholders) with the draft
        model's greedy tokens. Each chunk verifies [last known token, drafts...]."""
        if not chunks:
            return
        r = self.runner
        # Catch-up spans: decodes (one position) first, as the attention metadata wants.
        spans = []
        for c in chunks:
            st = r.states[c.request_id]
            first = min(st.draft_computed, c.start)
            spans.append((c, first, c.start + 1))
        spans.sort(key=lambda t: t[2] - t[1] != 1)
        ids = [tok for c, lo, hi in spans for tok in r.states[c.request_id].token_ids[lo:hi]]
        tokens = self._forward([c.request_id for c, _, _ in spans], [lo for _, lo, _ in spans],
                               [hi - lo for _, lo, hi in spans], torch.tensor(ids, dtype=torch.long))
        order = [c for c, _, _ in spans]
        k_of = [len(c.draft_token_ids) for c in order]
        idx = list(range(len(order)))  # the chains still running, as indices into `order`
        steps = [(idx, tokens)]
        for step in range(1, max(k_of)):
            live = [j for j, i in enumerate(idx) if k_of[i] > step]
            if len(live) < len(idx):
                tokens = tokens[torch.tensor(live, device=tokens.device)]
                idx = [idx[j] for j in live]
            # Draft `step` sits at position start + step; its logits give draft step + 1.
            tokens = self._forward([order[i].request_id for i in idx], [order[i].start + step for i in idx],
                                   [1] * len(idx), tokens)
            steps.append((idx, tokens))
        host = torch.cat([t for _, t in steps]).tolist()  # one wait for the whole chain
        drafts: list[list[int]] = [[] for _ in order]
        at = 0
        for rows, _ in steps:
            for i in rows:
                drafts[i].append(host[at])
                at += 1
        for c, got in zip(order, drafts, strict=True):
            c.draft_token_ids = got
            r.states[c.request_id].draft_computed = c.start + len(got)

    def _forward(self, rids: list[str], starts: list[int], lens: list[int],
                 ids: torch.Tensor) -> torch.Tensor:
        """One draft forward over `lens[i]` positions from `starts[i]` of each request;
        returns each request's greedy next token (on the device)."""
        r = self.runner
        n = len(rids)
        starts_a = np.asarray(starts, dtype=np.int64)
        lens_a = np.asarray(lens, dtype=np.int64)
        q_start = np.zeros(n, dtype=np.int64)
        np.cumsum(lens_a[:-1], out=q_start[1:])
        tables, _ = r.block_tables.gather(r.block_tables.rows(iter(rids), n))
        arrays = chunk_arrays(starts_a, lens_a, q_start, tables, r.block_size)
        arrays["ids"] = np.zeros(len(arrays["positions"]), dtype=np.int64)  # the ids are on the device
        num_decode = int((lens_a == 1).sum())
        _, pos, meta = r._metadata(arrays, num_decode, self.shape)
        hidden = self.model(ids.to(r.device), pos, self.kv_caches, meta)
        (last,) = r._to_device(q_start + lens_a - 1)
        logits = self.model.compute_logits(hidden.index_select(0, last))
        return logits.argmax(-1)
