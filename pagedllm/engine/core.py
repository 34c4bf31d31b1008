"""The engine core: the scheduler, the executor and the step that joins them.

It takes plain requests (token ids, sampling settings) and each step returns plain
per-sequence deltas (new token ids, finish reasons). Text, stop strings, n fan-out and
streaming belong to the front end (`pagedllm.engine.output_processor`); so the core runs
the same in-process, under the offline `LLM`, and in a process of its own under the server.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from pagedllm.config import EngineConfig, bidirectional
from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.draft_proposer import DraftModelProposer
from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.prefill_pacer import PrefillPacer
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.messages import CoreInfo, EngineCoreOutput, EngineCoreRequest, SchedulerStats
from pagedllm.engine.token_ids import token_ids_in_range
from pagedllm.executor import ExecutorDeadError, make_executor
from pagedllm.memory import full_length_sequences
from pagedllm.model_executor.loader.loader import load_hf_config
from pagedllm.model_source import ModelSource, resolve_source
from pagedllm.structured_output import SequenceGrammars, compiler_for
from pagedllm.structured_output import compiler as grammar_compiler
from pagedllm.tokenizers import load_tokenizer
from pagedllm.worker.cuda_graphs import mixed_graph_chunks

logger = logging.getLogger(__name__)


def _mixed_graph_buckets(config: EngineConfig) -> list[int]:
    """The prompt rows the worker's mixed-step CUDA graphs pad a chunk to (the pacer sizes
    chunks to them), where the worker captures such graphs: CUDA, graphs on, no LoRA. (A
    model whose prefills cannot replay from graphs, multi-head latent attention, runs those
    steps eagerly; its chunks are then whole buckets all the same.)"""
    if not str(config.device or "").startswith("cuda") or config.enforce_eager or config.enable_lora:
        return []
    return mixed_graph_chunks(config.max_prefill_tokens_with_decodes, paced=config.prefill_step_ratio is not None)


class StepError(RuntimeError):
    """The model step raised. Its sequences (`request_ids`) cannot go on; nothing else was
    touched, so the core can serve the rest once they are aborted."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"the model step of {len(request_ids)} sequences failed")
        self.request_ids = request_ids


def load_model_config(config: EngineConfig, source: ModelSource | None = None,
                      ) -> tuple[EngineConfig, ModelSource, object]:
    """The checkpoint's location (`source`, when already resolved) and config, and the
    engine config resolved against them."""
    if source is None:
        source = resolve_source(config.model, config.load_format, config.revision,
                                config.download_dir)
    hf_config = load_hf_config(source)
    for name, value in config.hf_overrides.items():  # as vLLM's hf_overrides: config attributes
        setattr(hf_config, name, value)
    if getattr(hf_config, "is_causal", True) is False and config.runner != "pooling":
        # A bidirectional embedding checkpoint asked to generate: only causal attention can
        # decode, so it is served causal (its embeddings then need --runner pooling).
        hf_config.is_causal = True
    # Sliding-window layers (Mistral v0.1, Qwen2 with use_sliding_window) are masked by the
    # attention backends. GGUF configs get transformers' default window, not the file's,
    # so none is applied to them.
    if source.kind != "hf" and getattr(hf_config, "sliding_window", None):
        hf_config.sliding_window = None
    if not config.resolved:
        import torch

        config = config.resolve(hf_config, torch.cuda.is_available())
    return config, source, hf_config


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config, source, self.hf_config = load_model_config(config)
        config = self.config
        # One ModelRunner in-process, or one worker per tensor-parallel rank: the same surface.
        self.executor = make_executor(config, source, self.hf_config, config.max_model_len)
        try:
            num_blocks = self.executor.determine_num_blocks(config.max_num_batched_tokens,
                                                            config.max_num_seqs)
            # the swap space in blocks: what one block of every rank's pages takes on its host
            swap_blocks = int(config.swap_space * 2**30) // self.executor.bytes_per_block
            self.executor.allocate_kv_cache(num_blocks, swap_blocks)
            if config.runner != "pooling":  # embeddings never decode
                self.executor.capture_graphs(config.max_num_seqs)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        spec = config.speculative_config
        proposer = None
        if spec is not None and spec.method == "draft_model":
            proposer = DraftModelProposer(spec.num_speculative_tokens, spec.max_batch_size,
                                          spec.min_acceptance_rate)
            logger.info("speculative decoding: draft model, %d tokens, off above %d decoding "
                        "sequences", spec.num_speculative_tokens, spec.max_batch_size)
        elif spec is not None:
            proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                     spec.prompt_lookup_max, spec.max_batch_size,
                                     spec.min_acceptance_rate)
            logger.info("speculative decoding: n-gram, %d tokens, lookup %d..%d, off above %d "
                        "decoding sequences", spec.num_speculative_tokens, spec.prompt_lookup_min,
                        spec.prompt_lookup_max, spec.max_batch_size)
        self._grammar_drafts = spec is not None and spec.method == "ngram"
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.max_prefill_tokens_with_decodes,
                                   proposer, config.max_loras if config.enable_lora else 0,
                                   swap_blocks)
        if swap_blocks:
            logger.info("swap space: %d blocks (%.1f GiB) of host memory for preempted sequences' pages",
                        swap_blocks, swap_blocks * self.executor.bytes_per_block / 2**30)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %d bytes a token (%s); %s",
                    num_blocks, config.block_size, num_blocks * config.block_size,
                    self.executor.bytes_per_block // config.block_size,
                    self.executor.page_spec.describe(),
                    full_length_sequences(num_blocks * config.block_size, config.max_model_len))
        self.async_scheduling = bool(config.async_scheduling)
        self._pacer = None
        if config.prefill_step_ratio is not None:
            trace = os.environ.get("PAGEDLLM_PACER_TRACE")  # a JSON line a step (prefill_pacer.py)
            self._pacer = PrefillPacer(config.prefill_step_ratio,
                                       config.max_prefill_tokens_with_decodes or config.max_num_batched_tokens,
                                       trace=open(trace, "a", buffering=1) if trace else None,
                                       buckets=_mixed_graph_buckets(config))
            self.scheduler.prefill_chunk_hint = self._pacer.chunk()
        self._launched: dict[int, float] = {}  # id(SchedulerOutput) -> when it was launched
        self._last_done: float | None = None  # when the last step's results were read
        self._inflight: tuple | None = None  # (SchedulerOutput, step handle) launched, not read
        self._stashed: list[EngineCoreOutput] = []  # read after a later step failed to launch
        self._penalized: set[str] = set()  # sequences whose sampling needs their full history
        # Constrained decoding: built when the first constrained request arrives, with the
        # front end's tokenizer when it shares this process (use_tokenizer), else its own.
        self._grammars: SequenceGrammars | None = None
        self._tokenizer = None
        # Constrained sequences waiting for their grammar's compile:
        # id -> (request, grammar source, future, deadline).
        self._compiling: dict[str, tuple] = {}

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op in-process); also done at interpreter exit."""
        self.executor.shutdown()

    # ------------------------------------------------------------------ info
    def describe(self) -> dict:
        """What an operator needs to tune: printed at startup."""
        c, ex, kv = self.config, self.executor, self.kv
        bs = c.block_size
        return {
            "model": c.model,
            "device": str(ex.device),
            "dtype": str(ex.dtype).replace("torch.", ""),
            "kv_cache_dtype": c.kv_cache_dtype,
            "weights_GiB": round(ex.weight_bytes / 2**30, 3),
            "kv_blocks": kv.num_blocks,
            "block_size": bs,
            "kv_tokens": kv.num_blocks * bs,
            "kv_GiB": round(kv.num_blocks * ex.bytes_per_block / 2**30, 3),
            "kv_bytes_per_token": ex.bytes_per_block // bs,
            "kv_pages": ex.page_spec.describe(),
            "max_model_len": c.max_model_len,
            "max_len_seqs_that_fit": round(kv.num_blocks * bs / c.max_model_len, 2),
            "kv_pool": full_length_sequences(kv.num_blocks * bs, c.max_model_len),
            "max_num_seqs": c.max_num_seqs,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            "max_prefill_tokens_with_decodes": c.max_prefill_tokens_with_decodes,
            "prefix_caching": c.enable_prefix_caching,
            "lora": (f"max_loras {c.max_loras}, max_lora_rank {c.max_lora_rank}"
                     if c.enable_lora else "off"),
        }

    def info(self) -> CoreInfo:
        return CoreInfo(vocab_size=self.executor.vocab_size, max_model_len=self.config.max_model_len,
                        pool_tokens=self.kv.num_blocks * self.kv.block_size,
                        describe=self.describe(), async_scheduling=self.async_scheduling,
                        max_lora_rank=self.config.max_lora_rank if self.config.enable_lora else 0,
                        lora_targets=list(self.executor.lora_targets))

    def stats(self) -> SchedulerStats:
        s, kv = self.scheduler, self.kv
        stats = SchedulerStats(len(s.running), len(s.waiting), kv.usage, kv.num_blocks,
                               kv.num_free_blocks, kv.prefix_queries, kv.prefix_hits,
                               s.num_preemptions_total, s.spec_num_drafts, s.spec_num_draft_tokens,
                               s.spec_num_accepted_tokens, list(s.spec_accepted_per_pos))
        if self.config.enable_lora:
            stats.running_loras = sorted({r.lora_request.lora_name for r in s.running if r.lora_request})
            stats.waiting_loras = sorted({r.lora_request.lora_name for r in s.waiting if r.lora_request})
        return stats

    # ------------------------------------------------------------------ requests
    def use_tokenizer(self, tokenizer) -> None:
        """The front end's tokenizer, when it runs in this process: constraints are then
        compiled once (its compile cache is per tokenizer) and no second copy is loaded."""
        self._tokenizer = tokenizer

    def _sequence_grammars(self) -> SequenceGrammars:
        if self._grammars is None:
            if self._tokenizer is None:
                if self.config.skip_tokenizer_init:
                    raise ValueError("structured_outputs needs the tokenizer "
                                     "(skip_tokenizer_init=False)")
                c = self.config
                source = resolve_source(c.model, c.load_format, c.revision, c.download_dir)
                self._tokenizer = load_tokenizer(source, self.config.tokenizer)
            self._grammars = SequenceGrammars(compiler_for(self._tokenizer, self.executor.vocab_size))
        return self._grammars

    def _constrained(self) -> bool:
        return self._grammars is not None and len(self._grammars) > 0

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one sequence; ValueError for one the model cannot take (the front end
        checks the same first, so that a client learns before anything is queued).

        A constrained sequence whose grammar is not compiled yet waits beside the
        scheduler until it is (`_admit_compiled`): a compile runs on a thread of its own
        and never holds up the steps of everyone else."""
        vocab = self.executor.vocab_size
        p = request.sampling_params
        ids = request.prompt_token_ids
        if not token_ids_in_range(ids, vocab):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if request.lora_request is not None and not self.config.enable_lora:
            raise ValueError("a LoRA adapter was requested but LoRA is off (enable_lora=True, "
                             "--enable-lora)")
        rid = request.request_id
        if rid in self._inflight_ids() or rid in self._compiling:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.pooling_params is not None:
            self._queue_pooling(request)
            return
        compiled = None
        if p.structured_outputs is not None:
            grammars = self._sequence_grammars()
            src, fut = grammars.compiler.submit(p.structured_outputs)
            if not fut.done():
                self._compiling[rid] = (request, src, fut, time.monotonic() + grammar_compiler.COMPILE_TIMEOUT_S)
                return
            compiled = grammars.compiler.outcome(fut.result())
        self._queue(request, compiled)

    def _queue(self, request: EngineCoreRequest, compiled) -> None:
        p = request.sampling_params
        eos = frozenset(request.eos_token_ids)
        p._all_stop_token_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        self.scheduler.add_request(Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            max_tokens=p.max_tokens, eos_token_ids=eos,
            stop_token_ids=frozenset(p.stop_token_ids), ignore_eos=p.ignore_eos,
            min_tokens=p.min_tokens, skip_prefix_cache=p.prompt_logprobs is not None,
            sampling_params=p, arrival_time=request.arrival_time,
            lora_request=request.lora_request,
            lora_int_id=request.lora_request.lora_int_id if request.lora_request else 0,
            # Verification samples every draft position from the same processed logits:
            # settings that change with each earlier token are not modelled there, except
            # a grammar, whose matcher gives each n-gram draft position its own mask (a
            # draft model's drafts are made on the worker, after the masks).
            allow_spec=not (p.needs_penalties or p.min_tokens or (
                (compiled is not None or p.structured_outputs is not None)
                and not self._grammar_drafts)),
        ))
        if p.needs_penalties:
            self._penalized.add(request.request_id)
        if compiled is not None:
            self._grammars.add(request.request_id,
                               self._grammars.new_matcher(compiled, request.eos_token_ids))

    def _queue_pooling(self, request: EngineCoreRequest) -> None:
        """A pooling request: its prompt is read in chunks like any other, and its last
        chunk is pooled instead of sampled. Mean and CLS pooling need every position's
        hidden state, so those read the whole prompt rather than take cached blocks."""
        pp = request.pooling_params
        whole = bidirectional(self.config, self.hf_config)  # read in one step, never cached
        self.scheduler.add_request(Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            max_tokens=0, skip_prefix_cache=pp.needs_every_position or whole, whole_prompt=whole,
            pooling=True, sampling_params=pp, arrival_time=request.arrival_time, allow_spec=False))

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the waiting sequences whose grammar has compiled; fail those whose compile
        failed or ran past its deadline. With nothing else to run, wait a moment for the
        first compile rather than spin."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished() and self._inflight is None:
            wait_futures([f for _, _, f, _ in self._compiling.values()], timeout=0.01,
                         return_when=FIRST_COMPLETED)
        failed: list[EngineCoreOutput] = []
        now = time.monotonic()
        for rid, (request, src, fut, deadline) in list(self._compiling.items()):
            if not fut.done() and now < deadline:
                continue
            del self._compiling[rid]
            try:
                if not fut.done():
                    raise self._grammars.compiler.timeout_error(
                        src, grammar_compiler.COMPILE_TIMEOUT_S)
                self._queue(request, self._grammars.compiler.outcome(fut.result()))
            except ValueError as e:
                failed.append(EngineCoreOutput(rid, finish_reason="error", error=str(e)))
        return failed

    def _inflight_ids(self) -> set[str]:
        """An aborted sequence's last step may still be running: its id is not free yet."""
        if self._inflight is None:
            return set()
        return {c.request_id for c in self._inflight[0].chunks}

    def abort_requests(self, request_ids: list[str]) -> None:
        """End these sequences now and free their blocks (unknown or finished ids: no-op)."""
        for rid in request_ids:
            self._compiling.pop(rid, None)
            self.scheduler.abort(rid)
            self.scheduler.release(rid)
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drop what the core kept for a sequence beside the scheduler."""
        self._penalized.discard(rid)
        if self._grammars is not None:
            self._grammars.remove(rid)

    def has_unfinished_requests(self) -> bool:
        """A step still in flight whose sequences have all ended (it computed one token past
        their end) does not count: the next step reads it, or nobody needs to."""
        return self.scheduler.has_unfinished() or bool(self._stashed) or bool(self._compiling)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineCoreOutput]:
        """One iteration: schedule, run, and report what each sequence gained.

        Under async scheduling a call schedules and launches step N+1, then reads step N
        (launched by the previous call): the host's scheduling and layout run while the
        device computes. Penalties need every earlier token on the host, so a sequence
        with them turns the overlap off while it runs (step N is read before N+1 is
        scheduled). A grammar's mask for the next token exists only once its matcher has
        taken the last one: with constrained sequences live, step N+1's forward pass is
        launched first, step N is read and its tokens fed to the matchers while that
        forward runs, and then N+1's sampling is launched under the masks (executors that
        cannot split a step read N first and send the masks with N+1)."""
        outputs, self._stashed = self._stashed, []
        outputs += self._admit_compiled()
        prev, self._inflight = self._inflight, None
        constrained = self._constrained()
        split = (constrained and self.async_scheduling
                 and getattr(self.executor, "supports_deferred_sampling", False))
        if prev is not None and (self._penalized or (constrained and not split)
                                 or self.scheduler.may_speculate()):
            outputs += self._complete(*prev)
            prev = None
        so = self.scheduler.schedule()
        defer = split and prev is not None and not self._penalized and not so.is_empty
        if constrained and not defer and not so.is_empty:
            so.grammar_bitmask = self._step_mask(so)
        if so.is_empty and not so.finished_req_ids:
            if prev is not None:
                outputs += self._complete(*prev)
            return outputs
        if self._pacer is not None and not so.is_empty:
            if len(self._launched) > 64:  # steps that failed are never read: forget them
                self._launched.clear()
            self._launched[id(so)] = time.monotonic()
        try:
            # An empty step still lets the worker drop aborted requests.
            ex = self.executor
            if defer:
                handle = ex.launch(so, defer_sampling=True)
            else:
                handle = ex.launch(so) if self.async_scheduling else ex.execute(so)
        except ExecutorDeadError:
            raise  # not this step's fault: nothing can run any more, every request must end
        except Exception as e:
            if prev is not None:  # its tokens are good: delivered by the next call
                outputs += self._complete(*prev)
            self._stashed = outputs
            raise StepError(self._live_ids(so)) from e
        if not self.async_scheduling:
            return outputs + self._process(so, handle)
        if any(c.draft_token_ids for c in so.chunks):
            # A verified step's token count is known only once it is read: nothing can be
            # laid out behind it (the step before it was read before it was scheduled).
            return outputs + self._complete(so, handle)
        if so.is_empty:
            handle.result()
        else:
            self._inflight = (so, handle)
        if prev is not None:
            try:
                outputs += self._complete(*prev)
            finally:
                if defer:  # the matchers now hold step N's tokens (or it failed)
                    handle.sample(self._step_mask(so) if self._grammars is not None else None)
        return outputs

    def _step_mask(self, so):
        """The grammar masks of a step's sampled rows (None: none is constrained)."""
        return self._grammars.bitmask([c.request_id for c in so.chunks if c.sample],
                                      {c.request_id: c.draft_token_ids for c in so.chunks
                                       if c.sample and c.draft_token_ids})

    def _live_ids(self, so) -> list[str]:
        reqs = self.scheduler.requests
        return [c.request_id for c in so.chunks if c.request_id in reqs]

    def _complete(self, so, handle) -> list[EngineCoreOutput]:
        """Wait for a launched step and report its tokens."""
        try:
            out = handle.result()
        except ExecutorDeadError:
            raise
        except Exception as e:
            raise StepError(self._live_ids(so)) from e
        return self._process(so, out)

    def _pace(self, so) -> None:
        """Time a step that was read (from its launch, or from when the step before it was
        read if it was queued behind that one) and let the pacer size the next prompt
        chunks (core/prefill_pacer.py)."""
        launched = self._launched.pop(id(so), None)
        now = time.monotonic()
        if launched is not None:
            start = launched if self._last_done is None else max(launched, self._last_done)
            self._pacer.observe(now - start, [(c.num_tokens, c.num_tokens > 1 + len(c.draft_token_ids))
                                              for c in so.chunks])
            self.scheduler.prefill_chunk_hint = self._pacer.chunk()
        self._last_done = now

    def _process(self, so, out) -> list[EngineCoreOutput]:
        if so.is_empty:
            return []
        if self._pacer is not None:
            self._pace(so)
        outs: dict[str, EngineCoreOutput] = {}
        for sid, why in out.failed.items():  # e.g. NaN logits: that sequence alone ends
            self.abort_requests([sid])
            outs[sid] = EngineCoreOutput(sid, finish_reason="error", error=why)
        for sid, vector in out.pooled.items():
            req = self.scheduler.requests.get(sid)
            if req is None or req.is_finished or sid in outs:
                continue  # aborted while its last chunk ran
            self.scheduler.finish(sid, RequestStatus.FINISHED_STOPPED)  # its blocks go back now
            self.scheduler.release(sid)
            outs[sid] = EngineCoreOutput(sid, finish_reason="stop", pooled=vector,
                                         num_cached_tokens=req.num_cached_tokens,
                                         scheduled_time=req.first_scheduled_time)
        for sid, entries in out.prompt_logprobs.items():
            if sid not in outs:
                outs[sid] = EngineCoreOutput(sid, new_prompt_logprobs=entries)
        for req, token in self.scheduler.update(so, out.sampled):
            sid = req.request_id
            o = outs.get(sid)
            if o is None:
                o = outs[sid] = EngineCoreOutput(sid)
            lp = out.logprobs.get(sid)
            if isinstance(lp, list):  # one entry per token of a verified chunk
                lp = lp[len(o.new_token_ids)] if len(o.new_token_ids) < len(lp) else None
            o.new_token_ids.append(token)
            if lp is not None:
                if o.new_logprobs is None:
                    o.new_logprobs = []
                o.new_logprobs.append(lp)
            if req.last_token_time is None:  # its first token
                o.num_cached_tokens = req.num_cached_tokens
                o.scheduled_time = req.first_scheduled_time
            req.last_token_time = time.monotonic()
            if not req.is_finished and self._grammars is not None and sid in self._grammars:
                accepted, complete = self._grammars.accept(sid, token)
                if not accepted:  # the mask forbade it: a bug, but this sequence's alone
                    self.scheduler.abort(sid)
                    o.error = "the sampled token breaks the request's structured_outputs"
                elif complete:  # the grammar took its end token (kept despite ignore_eos)
                    self.scheduler.finish(sid, RequestStatus.FINISHED_STOPPED)
            if req.is_finished:
                o.finish_reason = "error" if o.error else req.status.value
                o.stop_reason = req.stop_reason
                self.scheduler.release(sid)
                self._forget(sid)
        return list(outs.values())
