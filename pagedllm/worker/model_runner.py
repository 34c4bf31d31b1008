"""SchedulerOutput -> tensors -> model -> logits -> sampled tokens.

The runner keeps, per request, what sampling needs across steps (all token ids, settings,
its private generator when seeded), so the scheduler only sends each step which tokens to
compute and where they live in the cache.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, PrefillSeq, get_attention_backend
from pagedllm.config import EngineConfig
from pagedllm.memory import cpu_num_blocks, gpu_num_blocks, kv_bytes_per_token
from pagedllm.core.scheduler import SchedulerOutput
from pagedllm.model_executor.layers.sampler import Sampler, SamplingBatch, prompt_logprobs
from pagedllm.model_executor.loader import ModelSource, load_model
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    generator: torch.Generator | None
    prompt_lp_next: int = 1  # next prompt position whose logprob is still owed


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple[list[int], list[float], list[int]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], list[int]]]] = field(default_factory=dict)


def resolve_dtype(dtype: str, hf_config, device: torch.device) -> torch.dtype:
    names = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype != "auto":
        return names[dtype]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow or missing
    cfg = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    cfg = names.get(str(cfg).replace("torch.", ""), None) if cfg is not None else None
    return cfg if cfg in (torch.float16, torch.bfloat16) else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, hf_config, max_model_len: int):
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(config.dtype, hf_config, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.backend = get_attention_backend(self.device)
        self.model = load_model(source, hf_config, max_model_len, self.backend, self.device,
                                self.dtype, config.seed)
        s = self.model.shape
        self.num_layers, self.num_kv_heads, self.head_dim = s.num_layers, s.num_kv_heads, s.head_dim
        self.vocab_size = s.vocab
        gen = torch.Generator(device=self.device)
        gen.manual_seed(config.seed)
        self.sampler = Sampler(gen)
        self.states: dict[str, _ReqState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------------ memory
    @property
    def bytes_per_block(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return self.block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, elem)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

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
        """Peak memory of the largest step the scheduler may produce (weights included)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        nblk = -(-num_tokens // self.block_size)
        self.allocate_kv_cache(nblk)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device) % self.max_model_len
        meta = AttentionMetadata(torch.arange(num_tokens, device=self.device), 0, None, None, 0,
                                 [PrefillSeq(0, num_tokens, num_tokens, torch.arange(nblk, device=self.device))])
        with torch.inference_mode():
            h = self.model(ids, pos, self.kv_caches, meta)
            self.model.compute_logits(h[-min(num_tokens, 256):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        del h
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One zeroed [layers, 2, blocks, block_size, kv_heads, head_dim] tensor.

        Zeros matter: attention masks unused slots, but 0 * NaN from stale memory would
        still poison a row. On CPU the memory is an anonymous mapping, which the kernel
        zero-fills page by page on first touch, so a large pool costs nothing at start-up
        (an eager torch.zeros of 2 GiB spends seconds in page faults)."""
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            nbytes = math.prod(shape) * (torch.finfo(self.dtype).bits // 8)
            self._kv_mmap = mmap.mmap(-1, nbytes)
            cache = torch.frombuffer(self._kv_mmap, dtype=self.dtype).view(shape)
        else:
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(self.num_layers)]

    # ------------------------------------------------------------------ one step
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for new in so.new_requests:
            p: SamplingParams = new.sampling_params
            gen = None
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed)
            self.states[new.request_id] = _ReqState(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids), p, gen,
            )

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self._update_states(so)
        bs = self.block_size
        chunks = sorted(so.chunks, key=lambda c: c.num_tokens != 1)  # decodes first
        num_decode = sum(1 for c in chunks if c.num_tokens == 1)

        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        plp_rows: dict[str, tuple[list[int], list[int]]] = {}
        row = 0
        # Decodes: one token each, vectorised.
        if num_decode:
            dec = chunks[:num_decode]
            starts = np.fromiter((c.start for c in dec), dtype=np.int64, count=num_decode)
            width = max(len(c.block_table) for c in dec)
            tables = np.zeros((num_decode, width), dtype=np.int64)
            for i, c in enumerate(dec):
                tables[i, : len(c.block_table)] = c.block_table
                ids.append(self.states[c.request_id].token_ids[c.start])
            positions.append(starts)
            slots.append(tables[np.arange(num_decode), starts // bs] * bs + starts % bs)
            for i, c in enumerate(dec):
                self._owe_prompt_logprobs(c, i, plp_rows)
                if c.sample:  # a one-token prefill chunk attends like a decode but samples nothing
                    sample_rows.append(i)
                    sample_ids.append(c.request_id)
            row = num_decode
        for c in chunks[num_decode:]:
            st = self.states[c.request_id]
            pos = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            table = np.asarray(c.block_table, dtype=np.int64)
            ids.extend(st.token_ids[c.start : c.start + c.num_tokens])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            ctx = c.start + c.num_tokens
            prefills.append(PrefillSeq(row, c.num_tokens, ctx,
                                       torch.as_tensor(table[: -(-ctx // bs)], device=self.device)))
            self._owe_prompt_logprobs(c, row, plp_rows)
            if c.sample:
                sample_rows.append(row + c.num_tokens - 1)
                sample_ids.append(c.request_id)
            row += c.num_tokens

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_decode=num_decode,
            decode_block_tables=torch.from_numpy(tables).to(dev) if num_decode else None,
            decode_context_lens=torch.from_numpy(starts + 1).to(dev) if num_decode else None,
            max_decode_context=int(starts.max()) + 1 if num_decode else 0,
            prefills=prefills,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        hidden = self.model(input_ids, pos_t, self.kv_caches, meta)

        out = RunnerOutput()
        for rid, (rows_, targets) in plp_rows.items():
            k = self.states[rid].params.prompt_logprobs
            logits = self.model.compute_logits(hidden[rows_])
            out.prompt_logprobs[rid] = prompt_logprobs(logits, torch.tensor(targets, device=dev), k)
        if not sample_rows:
            return out
        logits = self.model.compute_logits(hidden[sample_rows])
        states = [self.states[r] for r in sample_ids]
        result = self.sampler(logits, self._sampling_batch(states, logits.shape[-1]))
        for rid, st, tok, lp in zip(sample_ids, states, result.token_ids, result.logprobs, strict=True):
            st.token_ids.append(tok)
            out.sampled[rid] = tok
            if lp is not None:
                out.logprobs[rid] = lp
        return out

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
                                      st.token_ids[lo + 1 : hi + 1])
            st.prompt_lp_next = hi + 1

    def _sampling_batch(self, states: list[_ReqState], vocab: int) -> SamplingBatch:
        dev = self.device
        params = [s.params for s in states]
        n = len(params)
        b = SamplingBatch(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev),
            generators=[s.generator for s in states],
            num_logprobs=[p.logprobs for p in params],
        )
        b.all_greedy = all(p.greedy for p in params)
        if not b.all_greedy:
            if any(p.top_k for p in params):
                b.top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)
            if any(p.top_p < 1.0 for p in params):
                b.top_p = torch.tensor([p.top_p for p in params], device=dev)
            if any(p.min_p > 0.0 for p in params):
                b.min_p = torch.tensor([p.min_p for p in params], device=dev)
        if any(p.needs_penalties for p in params):
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
        rows, toks, vals = [], [], []
        for i, s in enumerate(states):
            p = s.params
            for t, v in (p.logit_bias or {}).items():
                rows.append(i)
                toks.append(t)
                vals.append(v)
            if len(s.token_ids) - s.num_prompt < p.min_tokens:
                for t in p._all_stop_token_ids:
                    rows.append(i)
                    toks.append(t)
                    vals.append(float("-inf"))
        if rows:
            b.bias_rows = torch.tensor(rows, device=dev)
            b.bias_tokens = torch.tensor(toks, device=dev)
            b.bias_values = torch.tensor(vals, device=dev)
        return b
