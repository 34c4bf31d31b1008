"""SchedulerOutput -> tensors -> model -> logits -> sampled tokens.

The runner keeps, per request, what sampling needs across steps (all token ids, settings,
its private generator when seeded) and its block table (`BlockTables`), so the scheduler
only sends each step which tokens to compute and the blocks added since the last step.

A step is `launch`ed (everything queued on the device, nothing waited for) and its result
read later. Under async scheduling the engine launches step N+1 before reading step N: a
token step N sampled is then not known on the host when step N+1 is laid out, so step N+1
takes it from the device tensor step N sampled into (`_prev_tokens`).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm import batch_invariant
from pagedllm.attention import AttentionMetadata, get_attention_backend
from pagedllm.attention.metadata import LONG_DECODE_KEYS
from pagedllm.config import EngineConfig, env_flag
from pagedllm.core.scheduler import NewRequestData, ScheduledChunk, SchedulerOutput
from pagedllm.core.token_array import token_array
from pagedllm.distributed import broadcast_from_first
from pagedllm.memory import cpu_num_blocks, gpu_num_blocks
from pagedllm.model_executor.layers import pooler
from pagedllm.model_executor.layers.sampler import (
    SampledTensors,
    Sampler,
    SamplingBatch,
    prompt_logprobs,
)
from pagedllm.model_executor.loader import ModelSource, load_model
from pagedllm.pooling_params import PoolingParams, dense_folders, st_modules
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.block_table import BlockTables
from pagedllm.worker.cuda_graphs import (
    DecodeGraphs,
    MixedGraphs,
    VerifyGraphs,
    max_graph_batch,
    mixed_graph_chunks,
)
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.step_arrays import chunk_arrays, page_pool

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    token_ids: array  # prompt then output (pagedllm/core/token_array.py: the collector never visits its items)
    num_prompt: int
    params: SamplingParams | PoolingParams
    generator: torch.Generator | None
    lora: object = None  # its LoRARequest; None: the base model
    prompt_lp_next: int = 1  # next prompt position whose logprob is still owed
    num_pending: int = 0  # sampled by launched steps whose results are not read yet
    draft_computed: int = 0  # positions the draft model has KV for (draft_model speculation)
    # A pooling request: its vector so far (the chunks read before this step), on device.
    pool_partial: torch.Tensor | None = None

    @property
    def pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)


@dataclass
class RunnerOutput:
    # A list for a request whose chunk verified drafts: its accepted drafts and the token
    # after them; its logprobs then hold one entry per token, also as a list.
    sampled: dict[str, int | list[int]] = field(default_factory=dict)
    logprobs: dict[str, tuple[list[int], list[float], list[int]] | list] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], list[int]]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it cannot go on
    pooled: dict[str, bytes] = field(default_factory=dict)  # finished vectors, float32 '<f4'


def _replay_draws(gen: torch.Generator, state: torch.Tensor, n: int) -> None:
    """Put a generator where `n` single draws (as the sampler makes them) from `state`
    leave it: a seeded request's t-th token uses its t-th draw however steps group them."""
    gen.set_state(state)
    for _ in range(n):
        torch.rand(1, generator=gen, device=gen.device)


class LaunchedStep:
    """A step queued on the device. `result()` waits for its sampled tokens (copied to
    pinned host memory behind an event, so waiting blocks on this step alone) and turns
    them into a RunnerOutput; it is called exactly once.

    A step launched with `defer_sampling` has its forward pass queued and waits for
    `sample(step_mask)`: the engine fills the grammar masks of this step on the host while
    the device runs the forward, once the matchers have taken the previous step's tokens."""

    def __init__(self, runner: ModelRunner, out: RunnerOutput, sample_ids: list[str],
                 sampled: SampledTensors | None, valid: torch.Tensor | None,
                 pending: tuple | None = None, spec_counts: list[int] | None = None):
        self.runner, self.out, self.sample_ids = runner, out, sample_ids
        self.spec_counts = spec_counts  # rows per request of a step that verified drafts
        self.generator_states: dict[str, torch.Tensor] = {}  # seeded generators before a verify
        self.sampled, self.valid = sampled, valid
        self.pending = pending  # (logits, batch, states): sampling still to launch
        self.event = None
        if sampled is not None:
            self._copy_out()
        # Pooling requests finished by this step: (ids, vector sizes, all vectors in one
        # float32 tensor on the host, copied behind `pooled_event` on CUDA).
        self.pooled: tuple[list[str], list[int], torch.Tensor] | None = None
        self.pooled_event = None

    def set_pooled(self, ids: list[str], vectors: list[torch.Tensor]) -> None:
        flat = torch.cat(vectors)
        if self.runner.device.type == "cuda":  # into pinned memory, as the tokens are
            flat = flat.to("cpu", non_blocking=True)
            self.pooled_event = torch.cuda.Event()
            self.pooled_event.record()
        self.pooled = (ids, [len(v) for v in vectors], flat)

    def _read_pooled(self) -> None:
        if self.pooled is None:
            return
        if self.pooled_event is not None:
            self.pooled_event.synchronize()
        ids, sizes, flat = self.pooled
        self.pooled = None
        data = flat.numpy().astype("<f4", copy=False)
        start = 0
        for rid, n in zip(ids, sizes, strict=True):
            self.out.pooled[rid] = data[start : start + n].tobytes()
            start += n

    def _copy_out(self) -> None:
        if self.runner.device.type == "cuda":
            self.sampled = self.sampled.to(torch.device("cpu"), non_blocking=True)
            self.valid = self.valid.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def sample(self, step_mask) -> None:
        """Launch the sampling of a deferred step, under these grammar masks (a
        StepBitmask, or None when no row of the step is constrained)."""
        if self.pending is None:
            return
        logits, batch, states = self.pending
        self.pending = None
        self.sampled = self.runner.sample_rows(logits, batch, self.valid, states,
                                               self.sample_ids, step_mask)
        self._copy_out()

    def result(self) -> RunnerOutput:
        out, runner = self.out, self.runner
        if self.pending is not None:
            raise RuntimeError("a deferred step was read before it was sampled")
        self._read_pooled()
        if self.sampled is None:
            return out
        if self.event is not None:
            self.event.synchronize()
        if self.spec_counts is not None:
            return self._spec_result()
        tokens = broadcast_from_first(self.sampled.token_ids.tolist(), runner.device)  # TP ranks keep one history
        sampled = self.sampled.to_output(tokens)
        valid = self.valid.tolist()
        for i, rid in enumerate(self.sample_ids):
            st = runner.states.get(rid)
            if st is None:
                continue  # finished while this step ran: nothing to keep
            st.num_pending -= 1
            if not valid[i]:  # this request fails alone; the rest of the batch goes on
                out.failed[rid] = "the model produced non-finite logits (NaN or inf)"
                continue
            st.token_ids.append(tokens[i])
            out.sampled[rid] = tokens[i]
            if sampled.logprobs[i] is not None:
                out.logprobs[rid] = sampled.logprobs[i]
        return out


    def _spec_result(self) -> RunnerOutput:
        """A verified step: each request gets its accepted drafts and the token after them
        (a list in `sampled`, with one logprobs entry per token)."""
        out, runner = self.out, self.runner
        n = len(self.sampled.token_ids)
        flat = broadcast_from_first(self.sampled.token_ids.tolist() + self.sampled.accepted.tolist(),
                                    runner.device)  # TP ranks keep one history
        tokens, accepted = flat[:n], flat[n:]
        sampled = self.sampled.to_output(tokens)
        valid = self.valid.tolist()
        row = 0
        for rid, count in zip(self.sample_ids, self.spec_counts, strict=True):
            rows = range(row, row + count)
            row += count
            st = runner.states.get(rid)
            if st is None:
                continue
            st.num_pending -= 1
            if not all(valid[r] for r in rows):
                out.failed[rid] = "the model produced non-finite logits (NaN or inf)"
                continue
            emitted = []
            for r in rows:
                emitted.append(r)
                if not accepted[r]:
                    break
            toks = [tokens[r] for r in emitted]
            saved = self.generator_states.get(rid)
            if saved is not None and len(emitted) < count:
                _replay_draws(st.generator, saved, len(emitted))
            st.token_ids.extend(toks)
            out.sampled[rid] = toks if count > 1 else toks[0]
            if sampled.logprobs[rows[0]] is not None:
                lps = [sampled.logprobs[r] for r in emitted]
                out.logprobs[rid] = lps if count > 1 else lps[0]
        return out


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, max_model_len: int):
        if not config.resolved:
            raise ValueError("the model runner needs a resolved config (EngineConfig.resolve)")
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.block_size
        # fp8: e4m3 pages, one byte an element (the attention backends quantize on write
        # and dequantize on read, with each layer's scales)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype.startswith("fp8") else self.dtype
        self.max_model_len = max_model_len
        self.batch_invariant = bool(config.batch_invariant)
        self.backend = get_attention_backend(self.device, self.batch_invariant)
        self.model = load_model(source, hf_config, max_model_len, self.backend, self.device,
                                self.dtype, config.seed, config.quantization)
        # sentence-transformers' Dense modules after the pooling (embedding checkpoints)
        self.dense = pooler.load_dense(dense_folders(source.path, st_modules(source.path) or []),
                                       self.device)
        # Multi-LoRA: adapter slots in the model's projections, filled as steps need them.
        self.lora = None
        # request id -> why its adapter did not load ("" once reported), until it ends
        self._bad_lora: dict[str, str] = {}
        if config.enable_lora:
            self.lora = LoRAManager(self.model, config, self.device, self.dtype,
                                    max(config.max_num_batched_tokens, 256))
        s = self.model.shape
        self.num_layers, self.vocab_size = s.num_layers, s.vocab
        # What a token costs in every layer's pages: the model's attention layers say
        # (full K/V, an MLA latent); the pool is laid out from it and nothing else.
        self.page_spec = self.model.page_spec
        gen = torch.Generator(device=self.device)
        gen.manual_seed(config.seed)
        self.sampler = Sampler(gen)
        self.states: dict[str, _ReqState] = {}
        self.block_tables = BlockTables(-(-max_model_len // self.block_size))
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []  # per layer: its page_spec.parts
        self.graphs = None  # DecodeGraphs, captured after the KV cache exists (CUDA only)
        self.verify_graphs = None  # VerifyGraphs, for steps that verify drafts (speculation)
        self.mixed_graphs = None  # MixedGraphs, for decodes beside a capped prompt chunk
        # Tokens sampled by the latest launched step, on the device, and each request's row.
        self._prev_tokens: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        spec = config.speculative_config
        self.drafter = None  # DraftRunner: a draft model proposes the drafts on the worker
        if spec is not None and spec.method == "draft_model":
            from pagedllm.worker.draft_runner import DraftRunner

            self.drafter = DraftRunner(self, spec)

    # ------------------------------------------------------------------ memory
    @property
    def bytes_per_block(self) -> int:
        elem = torch.finfo(self.kv_dtype).bits // 8
        own = self.block_size * self.page_spec.bytes_per_token(self.num_layers, elem)
        return own + (self.drafter.bytes_per_block if self.drafter is not None else 0)

    @property
    def weight_bytes(self) -> int:
        models = [self.model] + ([self.drafter.model] if self.drafter is not None else [])
        return sum(p.numel() * p.element_size() for m in models for p in m.parameters())

    def determine_num_blocks(self, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            peak = self._profile_peak_gpu_bytes(max_num_batched_tokens)
            total = torch.cuda.get_device_properties(self.device).total_memory
            return gpu_num_blocks(total, self.config.gpu_memory_utilization, peak, self.bytes_per_block)
        return cpu_num_blocks(self.config.kv_cache_memory_bytes, self.bytes_per_block, max_num_seqs,
                              self.max_model_len, self.block_size)

    def _profile_peak_gpu_bytes(self, num_tokens: int) -> int:
        """Peak memory of the largest step the scheduler may produce (weights included, the
        profile's own page pool not: the real pool is sized from what is left)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # Sequences of at most max_model_len tokens filling the whole token budget.
        seq_lens = [min(self.max_model_len, num_tokens - i) for i in range(0, num_tokens, self.max_model_len)]
        per_seq = -(-self.max_model_len // self.block_size)
        # Each profiled sequence gets a whole max_model_len of pages, so its block table
        # has the full width the kernels may meet. That pool is scaffolding: at a long
        # max_model_len it is large (16 GiB for one 128k sequence of Llama-3.1-8B) and,
        # counted in the peak, would be taken from the real pool.
        before = torch.cuda.memory_allocated(self.device)
        self.allocate_kv_cache(per_seq * len(seq_lens))
        profile_pool = torch.cuda.memory_allocated(self.device) - before
        chunks = [ScheduledChunk(f"profile{i}", 0, n, list(range(i * per_seq, (i + 1) * per_seq)), False,
                                 full_table=True) for i, n in enumerate(seq_lens)]
        self._update_states(SchedulerOutput(
            new_requests=[NewRequestData(c.request_id, [0] * c.num_tokens, [], SamplingParams()) for c in chunks],
            chunks=chunks))
        _, arrays, _ = self._layout(chunks)
        self._update_states(SchedulerOutput(finished_req_ids=[c.request_id for c in chunks]))
        ids, pos, meta = self._metadata(arrays, 0)
        with torch.inference_mode(), batch_invariant.enabled(self.batch_invariant):
            h = self.model(ids, pos, self.kv_caches, meta)
            self.model.compute_logits(h[-min(num_tokens, 256):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - profile_pool
        self.release_kv_cache()
        del h
        torch.cuda.empty_cache()
        return peak

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Capture decode steps as CUDA graphs (needs the graph-safe Triton backend)."""
        if (self.device.type != "cuda" or self.config.enforce_eager
                or not getattr(self.backend, "graph_safe", False)
                or not getattr(self.model, "graph_safe", True)):  # a model's own attention may not be
            return
        max_blocks = -(-self.max_model_len // self.block_size)
        with torch.inference_mode(), batch_invariant.enabled(self.batch_invariant):
            # the second set, for one long context among short ones, where one can occur
            # (PAGEDLLM_LONG_DECODE_GRAPHS=0: none; such steps then replay the first set)
            long_variants = (self.max_model_len >= 2 * LONG_DECODE_KEYS
                             and getattr(self.backend, "splits_long_decodes", False)
                             and env_flag("PAGEDLLM_LONG_DECODE_GRAPHS", default=True))
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.device,
                                       min(max_num_seqs, max_graph_batch()), max_blocks,
                                       self.lora.batch if self.lora is not None else None, long_variants)
            spec = self.config.speculative_config
            # Verify steps run the prefill path; they stay eager with LoRA (its rows would
            # need the padded layout) and where a model lays prefills out from host lengths
            # (multi-head latent attention).
            if spec is not None and self.lora is None and getattr(self.model, "prefill_graph_safe", True):
                s = self.model.shape
                self.verify_graphs = VerifyGraphs(
                    self.model, self.kv_caches, self.device,
                    min(max_num_seqs, spec.max_batch_size), max_blocks,  # resolve() set the gate
                    spec.num_speculative_tokens + 1, self.backend.tile_q(s.num_heads // s.num_kv_heads))
            chunks = mixed_graph_chunks(self.config.max_prefill_tokens_with_decodes,
                                        paced=self.config.prefill_step_ratio is not None)
            if chunks and self.lora is None and getattr(self.model, "prefill_graph_safe", True):
                s = self.model.shape
                self.mixed_graphs = MixedGraphs(
                    self.model, self.kv_caches, self.device, min(max_num_seqs, 256), max_blocks, chunks,
                    self.backend.tile_q(s.num_heads // s.num_kv_heads))
                logger.info("mixed steps (decodes beside up to %d prompt rows) replay from %d CUDA graphs",
                            chunks[-1], len(self.mixed_graphs.graphs))

    def allocate_kv_cache(self, num_blocks: int, swap_blocks: int = 0) -> None:
        """One zeroed [layers, parts, blocks, block_size, *token_shape] tensor (page_spec:
        K and V of [kv_heads, head_dim] each, or one MLA latent), and the draft model's, of
        as many blocks: it writes the same slots. `swap_blocks`: host blocks of each (pinned
        on CUDA) that preempted sequences' pages are copied out to (swap_pages)."""
        cache, self._kv_mmap, self.kv_caches = page_pool(self.page_spec, self.num_layers, num_blocks,
                                                         self.block_size, self.kv_dtype, self.device,
                                                         self.backend)
        self._kv_pools = [cache]
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
            self._kv_pools.append(self.drafter.kv_pool)
        # fp8 pages are copied as bytes (index_copy_ has no fp8 kernel on every device)
        self._kv_pools = [p.view(torch.uint8) if p.element_size() == 1 else p for p in self._kv_pools]
        # block-major ([blocks, layers, parts, ...]): a sequence's run of host blocks is one
        # contiguous range, one copy each way
        self._host_pools = [torch.empty((swap_blocks, *p.shape[:2], *p.shape[3:]), dtype=p.dtype,
                                        pin_memory=self.device.type == "cuda") for p in self._kv_pools] \
            if swap_blocks else []

    def release_kv_cache(self) -> None:
        """Drop every reference to the page pool (the profile's scaffolding pool before the
        real one is allocated): the per-layer views, the pool tensors the swap copies read,
        the host pools and the draft model's pool. One reference kept is the whole pool kept:
        a profile pool of a 128k sequence is some 8 GiB taken from the real one."""
        self.kv_caches = []
        self._kv_pools, self._host_pools, self._kv_mmap = [], [], None
        if self.drafter is not None:
            self.drafter.release_kv_cache()

    def swap_pages(self, so: SchedulerOutput) -> None:
        """The step's swap copies, queued ahead of its forward on the device's stream: out
        (device blocks -> a run of host blocks) first, then in, since a block one frees may
        be the block the other fills. Stream order keeps them behind the steps that wrote the
        pages and ahead of any that overwrite them."""
        for ids, start in so.swap_out:
            idx = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
            for pool, host in zip(self._kv_pools, self._host_pools, strict=True):
                pages = pool.index_select(2, idx).movedim(2, 0).contiguous()
                host[start : start + len(ids)].copy_(pages, non_blocking=True)
        for start, ids in so.swap_in:
            idx = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
            for pool, host in zip(self._kv_pools, self._host_pools, strict=True):
                pages = host[start : start + len(ids)].to(self.device, non_blocking=True)
                pool.index_copy_(2, idx, pages.movedim(0, 2))

    # ------------------------------------------------------------------ one step
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply a step's deltas, in the order the scheduler made them: finished requests
        go before new ones (an id may be reused), blocks after both. Runs before anything
        else in `launch`, so a step that fails later leaves the state in step with the
        scheduler's."""
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
            self._bad_lora.pop(rid, None)
        for new in so.new_requests:
            p: SamplingParams | PoolingParams = new.sampling_params
            gen = None
            if isinstance(p, SamplingParams) and p.seed is not None and not p.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed)
            ids = token_array(new.prompt_token_ids)
            ids.extend(new.output_token_ids)
            self.states[new.request_id] = _ReqState(
                ids,
                len(new.prompt_token_ids), p, gen, new.lora_request,
            )
            if self.lora is not None and new.lora_request is not None:
                try:  # read now, so that an adapter that cannot load fails its request alone
                    self.lora.prefetch(new.lora_request)
                except ValueError as e:
                    self._bad_lora[new.request_id] = str(e)
        self.block_tables.update(so.finished_req_ids, so.chunks)

    def _layout(self, chunks) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """Host-side arrays of one step: token ids, positions, slots and per-sequence
        bookkeeping, computed with numpy rather than per-token Python. The block tables
        are one gather from the persistent `block_tables` (already updated by this step's
        deltas), whose block counts also check that every token has a slot."""
        bs = self.block_size
        n = len(chunks)
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=n)
        q_start = np.zeros(n, dtype=np.int64)
        np.cumsum(lens[:-1], out=q_start[1:])
        tables, counts = self.block_tables.gather(self.block_tables.rows((c.request_id for c in chunks), n))
        if (starts + lens > counts * bs).any():  # cheap: a lost delta would write stray slots
            raise RuntimeError("a scheduled chunk runs past its request's blocks on the worker")
        ids: list[int] = []
        fill_rows: list[int] = []
        fill_src: list[int] = []
        for c in chunks:
            toks = self.states[c.request_id].token_ids
            if c.num_tokens == 1:
                if c.start < len(toks):
                    ids.append(toks[c.start])
                else:  # sampled by the step still in flight: filled in on the device
                    fill_rows.append(len(ids))
                    fill_src.append(self._prev_rows[c.request_id])
                    ids.append(0)
            else:  # drafts follow the known tokens (speculative decoding)
                ids.extend(toks[c.start : c.start + c.num_tokens - len(c.draft_token_ids)])
                ids.extend(c.draft_token_ids)
        arrays = chunk_arrays(starts, lens, q_start, tables, bs)
        arrays["ids"] = np.asarray(ids, dtype=np.int64)
        total = len(arrays["positions"])
        if fill_rows:
            arrays["fill"] = np.array([fill_rows, fill_src], dtype=np.int64)
        return lens, arrays, total

    def _fill_pending(self, ids: torch.Tensor, arrays: dict[str, np.ndarray]) -> None:
        """Write the tokens the previous (unread) step sampled into this step's input ids."""
        fill = arrays.get("fill")
        if fill is None:
            return
        (idx,) = self._to_device(fill)
        ids.index_copy_(0, idx[0], self._prev_tokens.index_select(0, idx[1]).to(ids.dtype))

    def _metadata(self, arrays: dict[str, np.ndarray], num_decode: int, shape=None) -> tuple:
        """Move one step's arrays to the device in a single copy and build the metadata
        (for `shape`'s attention: the draft model's may group its heads otherwise)."""
        shape = shape or self.model.shape
        tile_q = getattr(self.backend, "tile_q", None)
        tiles = np.zeros((2, 0), dtype=np.int64)
        tq = num_tiles = 0
        if tile_q is not None:
            tq = tile_q(shape.num_heads // shape.num_kv_heads)
            lens = arrays["q_len"][num_decode:]
            counts = -(-lens // tq)
            seqs = np.repeat(np.arange(num_decode, num_decode + len(lens)), counts)
            first = np.zeros(len(counts), dtype=np.int64)
            np.cumsum(counts[:-1], out=first[1:])
            num_tiles = int(counts.sum())
            within = np.arange(num_tiles) - np.repeat(first, counts)
            tiles = np.zeros((2, -(-len(seqs) // 16) * 16), dtype=np.int64)  # rows 64-byte aligned
            tiles[0, : len(seqs)] = seqs
            tiles[1, : len(seqs)] = within * tq
        parts = [arrays[k].astype(np.int32, copy=False).ravel()
                 for k in ("ids", "positions", "slots", "q_start", "q_len", "ctx_len", "tables")]
        parts.append(tiles.astype(np.int32).ravel())
        # Each field starts on a 64-byte boundary: Triton specialises kernels on pointer
        # alignment, and unaligned views would compile a new variant for every batch shape.
        sizes = [len(p) for p in parts]
        padded = [-(-n // 16) * 16 for n in sizes]
        host = np.zeros(sum(padded), dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(padded)[:-1]])
        for off, part in zip(offsets, parts, strict=True):
            host[off : off + len(part)] = part
        (flat,) = self._to_device(host)
        ids, pos, slots, q_start, q_len, ctx, tables, tiles_t = (
            flat[off : off + n] for off, n in zip(offsets.tolist(), sizes, strict=True))
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode=num_decode,
            block_tables=tables.view(arrays["tables"].shape), q_start=q_start, q_len=q_len,
            ctx_len=ctx, prefill_tiles=tiles_t.view(2, -1), num_prefill_tiles=num_tiles, prefill_tile_q=tq,
            host_q_start=arrays["q_start"], host_q_len=arrays["q_len"],
            host_ctx_len=arrays["ctx_len"], host_block_tables=arrays["tables"],
        )
        if getattr(self.backend, "long_slots", False):  # index_copy_ wants int64 indices
            meta.slot_mapping = slots.long()
        return ids, pos, meta

    def _keep_metadata(self, arrays: dict[str, np.ndarray], keep: np.ndarray) -> AttentionMetadata:
        """The step's kept rows as decodes (AttentionMetadata.keep_meta): one query each,
        over its sequence's pages up to and including its own position."""
        seq = np.searchsorted(arrays["q_start"], keep, side="right") - 1
        n = len(keep)
        pos = arrays["positions"][keep]
        rows = {"ids": np.zeros(n, dtype=np.int64), "positions": pos, "slots": arrays["slots"][keep],
                "q_start": np.arange(n, dtype=np.int64), "q_len": np.ones(n, dtype=np.int64),
                "ctx_len": pos + 1, "tables": arrays["tables"][seq]}
        return self._metadata(rows, n)[2]

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, defer_sampling: bool = False) -> LaunchedStep:
        """Queue one step on the device. Nothing here waits for the device unless the step
        owes prompt logprobs (rare: those are read at once). With `defer_sampling` only
        the forward pass is queued; the handle's `sample` queues the rest."""
        with batch_invariant.enabled(self.batch_invariant):
            return self._launch(so, defer_sampling)

    def _launch(self, so: SchedulerOutput, defer_sampling: bool) -> LaunchedStep:
        if so.swap_out or so.swap_in:
            self.swap_pages(so)
        self._update_states(so)
        if self.drafter is not None:  # the scheduler reserved the slots; the draft fills them
            self.drafter.propose([c for c in so.chunks if c.draft_token_ids])
        chunks = sorted(so.chunks, key=lambda c: c.num_tokens != 1)  # decodes first
        out = RunnerOutput()
        if self._bad_lora:  # these fail alone (the core aborts them); the rest runs
            for c in chunks:  # reported once; a step scheduled before the abort skips them
                if self._bad_lora.get(c.request_id):
                    out.failed[c.request_id] = self._bad_lora[c.request_id]
                    self._bad_lora[c.request_id] = ""
            chunks = [c for c in chunks if c.request_id not in self._bad_lora]
        num_decode = sum(1 for c in chunks if c.num_tokens == 1)
        if not chunks:
            return LaunchedStep(self, out, [], None, None)
        lens, arrays, _ = self._layout(chunks)
        row_ends = arrays["q_start"] + lens
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        plp_rows: dict[str, tuple[list[int], list[int]]] = {}
        drafts: list[int] = []  # per sampled row: the token proposed after it, -1 for none
        plan = pooler.PoolingPlan()
        pool_ids: list[str] = []
        for c, start, end in zip(chunks, arrays["q_start"].tolist(), row_ends.tolist(), strict=True):
            st = self.states[c.request_id]
            if st.pooling:  # pooled, never sampled
                plan.chunks.append(pooler.PoolingChunk(st.params, start, c.start, c.num_tokens,
                                                       st.num_prompt, c.sample))
                pool_ids.append(c.request_id)
                continue
            self._owe_prompt_logprobs(c, start, plp_rows)
            if c.sample:  # a chunk short of the end of the prompt samples nothing
                d = len(c.draft_token_ids)  # speculative: the logits of every draft position
                sample_rows.extend(range(end - 1 - d, end))
                sample_ids.append(c.request_id)
                drafts.extend(c.draft_token_ids)
                drafts.append(-1)
        if self.lora is not None:  # each row's adapter slot (adapters loaded as needed)
            slots = self.lora.slots_for([self.states[c.request_id].lora for c in chunks])
            arrays["lora_slots"] = np.repeat(np.asarray(slots, dtype=np.int32), lens)
        spec_counts = None
        if len(sample_rows) > len(sample_ids):
            spec_counts = [len(c.draft_token_ids) + 1 for c in chunks
                           if c.sample and not self.states[c.request_id].pooling]

        graph_logits = sample_logits = None  # sample_logits: already the sampled rows'
        if self.graphs is not None and num_decode == len(chunks) and not plp_rows and not pool_ids:
            graph_logits = self.graphs.run(arrays, lambda ids: self._fill_pending(ids, arrays))
        elif (self.verify_graphs is not None and spec_counts is not None and not plp_rows and not pool_ids
              and all(c.sample and c.num_tokens == len(c.draft_token_ids) + 1 for c in chunks)):
            graph_logits = self.verify_graphs.run(arrays)
        elif (self.mixed_graphs is not None and 0 < num_decode < len(chunks) and spec_counts is None
              and not plp_rows and not pool_ids):
            sample_logits = self.mixed_graphs.run(arrays, num_decode, sample_rows,
                                                 lambda ids: self._fill_pending(ids, arrays))
        if graph_logits is None and sample_logits is None:
            if self.lora is not None:
                self.lora.prepare(arrays["lora_slots"], len(arrays["lora_slots"]))
            ids, pos, meta = self._metadata(arrays, num_decode)
            self._fill_pending(ids, arrays)
            num_rows = len(ids)
            if len(sample_rows) < num_rows and self.lora is None and not plp_rows and not pool_ids:
                # only the sampled rows' outputs are read (none: a chunk short of its
                # prompt's end): the last layer skips the rest
                if not sample_rows:
                    meta.keep_rows = torch.empty(0, dtype=torch.int64, device=self.device)
                else:
                    keep = np.asarray(sample_rows, dtype=np.int64)
                    (meta.keep_rows,) = self._to_device(keep)
                    if not self.batch_invariant and hasattr(self.backend, "write_kv"):
                        meta.keep_meta = self._keep_metadata(arrays, keep)
            hidden = self.model(ids, pos, self.kv_caches, meta)
            if hidden.shape[0] != num_rows and sample_rows:  # the sampled rows (keep_rows), in order
                sample_logits = self.model.compute_logits(hidden)

        for rid, (rows_, targets) in plp_rows.items():
            k = self.states[rid].params.prompt_logprobs
            logits = self.model.compute_logits(hidden[rows_])
            out.prompt_logprobs[rid] = prompt_logprobs(logits, torch.tensor(targets, device=self.device), k)
        pooled = self._pool(hidden, plan, pool_ids) if pool_ids else None
        if not sample_rows:
            self._prev_tokens, self._prev_rows = None, {}
            return self._with_pooled(LaunchedStep(self, out, [], None, None), pooled)
        if sample_logits is not None:
            logits = sample_logits
        else:
            (rows,) = self._to_device(np.asarray(sample_rows, dtype=np.int64))
            if graph_logits is not None:
                logits = graph_logits.index_select(0, rows)
            else:
                logits = self.model.compute_logits(hidden.index_select(0, rows))
        # NaN propagates through amax and +inf wins; -inf only when all are -inf: a row
        # with none finite cannot be sampled from. Read with the tokens, not here.
        valid = torch.isfinite(logits.amax(-1))
        states = [self.states[r] for r in sample_ids]
        if spec_counts is not None:
            return self._with_pooled(self._verify(out, logits, valid, states, sample_ids,
                                                  spec_counts, drafts, so.grammar_bitmask), pooled)
        batch = self._sampling_batch(states, logits.shape[-1])
        if defer_sampling:
            step = LaunchedStep(self, out, sample_ids, None, valid, (logits, batch, states))
            return self._with_pooled(step, pooled)
        sampled = self.sample_rows(logits, batch, valid, states, sample_ids, so.grammar_bitmask)
        return self._with_pooled(LaunchedStep(self, out, sample_ids, sampled, valid), pooled)

    @staticmethod
    def _with_pooled(step: LaunchedStep, pooled: tuple | None) -> LaunchedStep:
        if pooled is not None and pooled[0]:
            step.set_pooled(*pooled)
        return step

    def _pool(self, hidden: torch.Tensor, plan: pooler.PoolingPlan, ids: list[str]
              ) -> tuple[list[str], list[torch.Tensor]]:
        """Reduce this step's pooling chunks; keep the partial vectors of unfinished
        prompts, and return the finished vectors (on the device). A chunk starting at
        position 0 begins afresh: a preempted request reads its prompt again."""
        rows, segs = plan.rows()
        rows_t, segs_t = self._to_device(rows, segs)
        is_max = [c.params.pooling_type == "MAX" for c in plan.chunks]
        # Sums for the other poolings, maxima for MAX: each reduction only if a chunk needs it.
        parts = None if all(is_max) else pooler.partial_sums(hidden, rows_t, segs_t, len(plan.chunks))
        if any(is_max):
            maxes = pooler.partial_maxes(hidden, rows_t, segs_t, len(plan.chunks))
            if parts is None:
                parts = maxes
            else:
                (pick,) = self._to_device(np.asarray(is_max, dtype=np.bool_))
                parts = torch.where(pick.unsqueeze(1), maxes, parts)
        done_idx: list[int] = []
        for i, (rid, c) in enumerate(zip(ids, plan.chunks, strict=True)):
            st = self.states[rid]
            if c.start > 0 and st.pool_partial is not None:
                if is_max[i]:
                    parts[i] = torch.maximum(parts[i], st.pool_partial)
                else:
                    parts[i] += st.pool_partial
            st.pool_partial = None if c.last else parts[i].clone()
            if c.last:
                done_idx.append(i)
        if not done_idx:
            return [], []
        done = [plan.chunks[i] for i in done_idx]
        vectors = parts if len(done_idx) == len(ids) else parts[done_idx]
        divisors = [pooler.divisor(c.params, c.num_prompt) for c in done]
        return [ids[i] for i in done_idx], pooler.finish(vectors, [c.params for c in done], divisors,
                                                         self.dense)

    @torch.inference_mode()
    def sample_rows(self, logits: torch.Tensor, batch: SamplingBatch, valid: torch.Tensor,
                    states: list[_ReqState], sample_ids: list[str], step_mask) -> SampledTensors:
        """Sample a step's rows (under its grammar masks, if any) and keep the tokens on
        the device for the next step's inputs."""
        if step_mask is not None:
            self._grammar_rows(batch, step_mask, sample_ids)
        sampled = self.sampler.sample(logits, batch, valid)
        for st in states:
            st.num_pending += 1
        self._prev_tokens = sampled.token_ids
        self._prev_rows = {rid: i for i, rid in enumerate(sample_ids)}
        return sampled

    def _verify(self, out: RunnerOutput, logits: torch.Tensor, valid: torch.Tensor,
                states: list[_ReqState], sample_ids: list[str], counts: list[int],
                drafts: list[int], step_mask) -> LaunchedStep:
        """Sample a step that checks speculative drafts: one logits row per position, each
        row under its request's settings (its seeded generator draws them in order)."""
        row_states = [st for st, n in zip(states, counts, strict=True) for _ in range(n)]
        row_ids = [rid for rid, n in zip(sample_ids, counts, strict=True) for _ in range(n)]
        batch = self._sampling_batch(row_states, logits.shape[-1])
        if step_mask is not None:  # a row per verified position of a constrained request
            self._grammar_rows(batch, step_mask, row_ids)
        (draft,) = self._to_device(np.asarray(drafts, dtype=np.int64))
        # Each row draws one uniform from its request's generator; the rows past the
        # first rejection must not have drawn: the result rewinds to here and replays.
        saved = {rid: st.generator.get_state() for rid, st in zip(sample_ids, states, strict=True)
                 if st.generator is not None}
        sampled = self.sampler.verify(logits, batch, draft, valid)
        for st in states:
            st.num_pending += 1
        self._prev_tokens, self._prev_rows = None, {}  # async scheduling is off with drafts
        step = LaunchedStep(self, out, sample_ids, sampled, valid, spec_counts=counts)
        step.generator_states = saved
        return step

    def _owe_prompt_logprobs(self, c, row: int, plp_rows: dict) -> None:
        """Rows of this chunk whose logits give prompt logprobs not yet reported
        (position p predicts prompt token p + 1; a recomputed chunk reports nothing twice)."""
        st = self.states[c.request_id]
        if st.params.prompt_logprobs is None:
            return
        lo = max(c.start, st.prompt_lp_next - 1)
        hi = min(c.start + c.num_tokens, st.num_prompt - 1)
        if hi > lo:
            plp_rows[c.request_id] = (list(range(row + lo - c.start, row + hi - c.start)),
                                      st.token_ids[lo + 1 : hi + 1].tolist())
            st.prompt_lp_next = hi + 1

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Host arrays to the device without waiting for it: a plain `torch.tensor(...,
        device=cuda)` copies from pageable memory and so waits for every queued kernel,
        which would stall async scheduling until the previous step ends."""
        tensors = [torch.from_numpy(a) for a in arrays]
        if self.device.type != "cuda":
            return tensors
        return [t.pin_memory().to(self.device, non_blocking=True) for t in tensors]

    def _grammar_rows(self, b: SamplingBatch, step_mask, sample_ids: list[str]) -> None:
        """Place a step's grammar masks (a StepBitmask: one row per constrained sequence)
        on the rows of the sampled batch; the other rows' words are all ones and are not
        touched when the mask is applied (only the listed rows are)."""
        # A request verifying drafts has several rows, in order, in both lists.
        rows_of: dict[str, list[int]] = {}
        for i, rid in enumerate(sample_ids):
            rows_of.setdefault(rid, []).append(i)
        taken: dict[str, int] = {}
        rows = []
        for rid in step_mask.request_ids:
            j = taken.get(rid, 0)
            rows.append(rows_of[rid][j])
            taken[rid] = j + 1
        full = np.full((len(sample_ids), step_mask.bitmask.shape[1]), -1, dtype=np.int32)
        full[rows] = step_mask.bitmask
        if len(rows) == len(sample_ids):  # every row: no index list at all
            (b.grammar_bitmask,) = self._to_device(full)
            b.grammar_rows = None
        else:  # the rows go over as a device tensor: a Python list would be copied from
            # pageable memory, which waits for the forward pass queued before it
            b.grammar_bitmask, b.grammar_rows = self._to_device(full, np.asarray(rows, np.int32))

    def _sampling_batch(self, states: list[_ReqState], vocab: int) -> SamplingBatch:
        dev = self.device
        params = [s.params for s in states]
        n = len(params)
        b = SamplingBatch(temperature=None, generators=[s.generator for s in states],
                          num_logprobs=[p.logprobs for p in params])
        b.all_greedy = all(p.greedy for p in params)
        b.any_greedy = any(p.greedy for p in params)
        floats: dict[str, list[float]] = {"temperature": [0.0 if p.greedy else p.temperature for p in params]}
        ints: dict[str, list[int]] = {}
        if not b.all_greedy:
            if any(p.top_k for p in params):
                ints["top_k"] = [p.top_k or vocab for p in params]
            if any(p.top_p < 1.0 for p in params):
                floats["top_p"] = [p.top_p for p in params]
            if any(p.min_p > 0.0 for p in params):
                floats["min_p"] = [p.min_p for p in params]
        rows, toks, vals = [], [], []
        for i, s in enumerate(states):
            p = s.params
            for t, v in (p.logit_bias or {}).items():
                rows.append(i)
                toks.append(t)
                vals.append(v)
            if len(s.token_ids) + s.num_pending - s.num_prompt < p.min_tokens:
                for t in p._all_stop_token_ids:
                    rows.append(i)
                    toks.append(t)
                    vals.append(float("-inf"))
        if rows:
            floats["bias_values"] = vals
            ints["bias_rows"], ints["bias_tokens"] = rows, toks
        # Two copies in all (floats, ints), each field a slice of one device buffer.
        for fields, dtype in ((floats, np.float32), (ints, np.int64)):
            if not fields:
                continue
            (flat,) = self._to_device(np.concatenate([np.asarray(v, dtype=dtype) for v in fields.values()]))
            start = 0
            for name, v in fields.items():
                setattr(b, name, flat[start : start + len(v)])
                start += len(v)
        if any(p.needs_penalties for p in params):
            if any(s.num_pending for s in states):
                raise RuntimeError("penalties need every sampled token on the host: "
                                   "such requests must run without async scheduling")
            b.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            b.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            b.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
            counts = torch.zeros((n, vocab), device=dev)
            seen = torch.zeros((n, vocab), dtype=torch.bool, device=dev)
            for i, s in enumerate(states):
                if not s.params.needs_penalties:
                    continue
                out_ids = torch.tensor(s.token_ids[s.num_prompt :], dtype=torch.long, device=dev)
                counts[i].index_add_(0, out_ids, torch.ones(len(out_ids), device=dev))
                seen[i, torch.tensor(s.token_ids, dtype=torch.long, device=dev)] = True
            b.output_counts, b.seen_mask = counts, seen
        return b
