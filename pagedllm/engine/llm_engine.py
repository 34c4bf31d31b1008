"""The engine core: one `step()` = schedule, execute, update, turn tokens into outputs.

Synchronous and single-threaded on purpose: the offline `LLM` calls `step()` in a loop, and
the async front end runs the same loop on its own thread.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.output_processor import OutputProcessor, child_id
from pagedllm.executor import ExecutorDeadError, make_executor
from pagedllm.executor.uniproc import UniprocExecutor
from pagedllm.metrics import EngineMetrics
from pagedllm.model_executor.loader.loader import load_hf_config, resolve_source
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizers import load_tokenizer


class StepError(RuntimeError):
    """The model step raised. Its requests (`request_ids`, user request ids) cannot go on;
    nothing else was touched, so the engine can serve the rest once they are aborted."""

    def __init__(self, request_ids: list[str]):
        super().__init__(f"the model step of {len(request_ids)} requests failed")
        self.request_ids = request_ids


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int


def _eos_ids(hf_config, tokenizer, model_path: str) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(x) for x in src)
    gen_cfg = os.path.join(model_path, "generation_config.json")
    if os.path.isdir(model_path) and os.path.exists(gen_cfg):
        import json

        with open(gen_cfg) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source = resolve_source(config.model, config.load_format)
        self.hf_config = load_hf_config(source)
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        # Sliding-window layers (Mistral v0.1, Qwen2 with use_sliding_window) are masked by
        # the attention backends. GGUF configs get transformers' default window, not the
        # file's, so none is applied to them.
        if source.kind != "hf" and getattr(self.hf_config, "sliding_window", None):
            self.hf_config.sliding_window = None
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {limit} positions")
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(source, config.tokenizer)
        # One ModelRunner in-process, or one worker per tensor-parallel rank: the same surface.
        self.runner = make_executor(config, source, self.hf_config, self.max_model_len)
        try:
            self._start(config, source)
        except BaseException:
            self.runner.shutdown()
            raise

    def _start(self, config: EngineConfig, source) -> None:
        on_gpu = self.runner.device.type == "cuda"
        self.max_num_batched_tokens = config.max_num_batched_tokens or (8192 if on_gpu else 2048)
        num_blocks = self.runner.determine_num_blocks(self.max_num_batched_tokens, config.max_num_seqs)
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs(config.max_num_seqs)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = _eos_ids(self.hf_config, self.tokenizer, source.path)
        self._num_seqs: dict[str, int] = {}
        auto = on_gpu and isinstance(self.runner, UniprocExecutor)  # one device, in this process
        self.async_scheduling = auto if config.async_scheduling is None else config.async_scheduling
        self._inflight: tuple | None = None  # (SchedulerOutput, step handle) launched, not read
        self._stashed: list[RequestOutput] = []  # read after a later step failed to launch
        self._penalized: set[str] = set()  # sequences whose sampling needs their full history
        self.metrics = EngineMetrics(config.model_name)
        self.metrics.update_pool(self.stats())

    def shutdown(self) -> None:
        """Stop the executor's workers (a no-op in-process); also done at interpreter exit."""
        self.runner.shutdown()

    # ------------------------------------------------------------------ info
    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    def describe(self) -> dict:
        """What an operator needs to tune: printed at startup."""
        bs = self.config.block_size
        return {
            "model": self.config.model,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "weights_GiB": round(self.runner.weight_bytes / 2**30, 3),
            "kv_blocks": self.kv.num_blocks,
            "block_size": bs,
            "kv_tokens": self.kv.num_blocks * bs,
            "kv_GiB": round(self.kv.num_blocks * self.runner.bytes_per_block / 2**30, 3),
            "max_model_len": self.max_model_len,
            "max_len_seqs_that_fit": round(self.kv.num_blocks * bs / self.max_model_len, 2),
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "prefix_caching": self.config.enable_prefix_caching,
        }

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.kv.usage, self.kv.num_blocks,
                           self.kv.num_free_blocks, self.kv.prefix_queries, self.kv.prefix_hits,
                           s.num_preemptions_total)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs the tokenizer (skip_tokenizer_init=False)")
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                    params: SamplingParams) -> None:
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(prompt or "")
        prompt_token_ids = list(prompt_token_ids)
        vocab = self.runner.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if params.logprobs is not None and params.logprobs > 20:
            raise ValueError(f"logprobs must be at most 20, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > 20:
            raise ValueError(f"prompt_logprobs must be at most 20, got {params.prompt_logprobs}")
        if request_id in self._num_seqs or self._in_flight(request_id, params.n):
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_token_ids)
        children = []
        for i in range(params.n):
            p = params.clone()
            p.max_tokens = max_tokens
            if params.seed is not None and i:
                p.seed = params.seed + i
            if i:
                p.prompt_logprobs = None
            p._all_stop_token_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            children.append(Request(
                request_id=child_id(request_id, i, params.n), prompt_token_ids=prompt_token_ids,
                max_tokens=max(1, max_tokens), eos_token_ids=self.eos_token_ids,
                stop_token_ids=frozenset(p.stop_token_ids), ignore_eos=p.ignore_eos,
                min_tokens=p.min_tokens, sampling_params=p,
            ))
        added = []
        try:
            for req in children:
                self.scheduler.add_request(req)
                added.append(req)
        except ValueError:
            for req in added:
                self.scheduler.abort(req.request_id)
                self.scheduler.release(req.request_id)
            raise
        self._num_seqs[request_id] = params.n
        self._penalized.update(r.request_id for r in children if r.sampling_params.needs_penalties)
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        self.output_processor.add(request_id, prompt, prompt_token_ids, [r.sampling_params for r in children])

    def _in_flight(self, request_id: str, n: int) -> bool:
        """An aborted request's last step may still be running: its id is not free yet."""
        if self._inflight is None:
            return False
        ids = {c.request_id for c in self._inflight[0].chunks}
        return any(child_id(request_id, i, n) in ids for i in range(n))

    def abort_request(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request now and free its blocks; `reason` is its finish reason ("abort",
        or "error" when the engine failed it)."""
        n = self._num_seqs.pop(request_id, None)
        if n is None:
            return None
        for i in range(n):
            cid = child_id(request_id, i, n)
            self.scheduler.abort(cid)
            self.scheduler.release(cid)
            self._penalized.discard(cid)
        self.metrics.request_finished(reason)
        self.metrics.update_pool(self.stats())
        return self.output_processor.abort(request_id, reason)

    def has_unfinished_requests(self) -> bool:
        """A step still in flight whose requests have all ended (it computed one token past
        their end) does not count: the next step reads it, or nobody needs to."""
        return self.scheduler.has_unfinished() or bool(self._stashed)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine iteration. With `final_only`, outputs are built only for requests
        that finished (the offline API needs nothing else, and skipping the per-step
        copies keeps the loop lean at hundreds of sequences).

        Under async scheduling a step schedules and launches step N+1, then reads step N
        (launched by the previous call): the host's scheduling, layout and output work
        runs while the device computes. A request whose sampling needs its whole history
        on the host (penalties) turns the overlap off while it runs."""
        outputs, self._stashed = self._stashed, []
        prev, self._inflight = self._inflight, None
        if prev is not None and self._penalized:
            outputs += self._complete(*prev, final_only)
            prev = None
        so = self.scheduler.schedule()
        if so.is_empty and not so.finished_req_ids:
            if prev is not None:
                outputs += self._complete(*prev, final_only)
            return outputs
        try:
            # An empty step still lets the worker drop aborted requests.
            handle = self.runner.launch(so) if self.async_scheduling else self.runner.execute(so)
        except ExecutorDeadError:
            raise  # not this step's fault: nothing can run any more, every request must end
        except Exception as e:
            if prev is not None:  # its tokens are good: delivered by the next call
                outputs += self._complete(*prev, final_only)
            self._stashed = outputs
            raise StepError(self._owners(so)) from e
        if not self.async_scheduling:
            return outputs + self._process(so, handle, final_only)
        if so.is_empty:
            handle.result()
        else:
            self._inflight = (so, handle)
        if prev is not None:
            outputs += self._complete(*prev, final_only)
        return outputs

    def _owners(self, so) -> list[str]:
        owners = self.output_processor.seq_owner
        return list({owners[c.request_id][0]: None for c in so.chunks if c.request_id in owners})

    def _complete(self, so, handle, final_only: bool) -> list[RequestOutput]:
        """Wait for a launched step and turn its tokens into outputs."""
        try:
            out = handle.result()
        except ExecutorDeadError:
            raise
        except Exception as e:
            raise StepError(self._owners(so)) from e
        return self._process(so, out, final_only)

    def _process(self, so, out, final_only: bool) -> list[RequestOutput]:
        if so.is_empty:
            return []
        failed = []
        for sid, why in out.failed.items():  # e.g. NaN logits: that request alone ends
            pid = self.output_processor.seq_owner.get(sid, ("", 0))[0]
            o = self.abort_request(pid, "error")
            if o is not None:
                o.error = why
                failed.append(o)
        for sid, entries in out.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(sid, entries)
        touched: dict[str, None] = {}
        now = time.monotonic()
        ttft: list[float] = []
        queue: list[float] = []
        itl: list[float] = []
        proc = self.output_processor
        results = self.scheduler.update(so, out.sampled)
        for req, token in results:
            sid = req.request_id
            if req.last_token_time is None:
                ttft.append(now - req.arrival_time)
                queue.append((req.first_scheduled_time or now) - req.arrival_time)
                proc.set_cached_tokens(sid, req.num_cached_tokens)
            else:
                itl.append(now - req.last_token_time)
            req.last_token_time = now
            finish = req.status.value if req.is_finished else None
            hit = proc.add_token(sid, token, out.logprobs.get(sid), finish, req.stop_reason)
            if hit is not None:
                self.scheduler.finish_by_stop_string(sid, hit)
            if req.is_finished:
                self.scheduler.release(sid)
                self._penalized.discard(sid)
            touched[proc.parent_id(sid)[0]] = None
        m = self.metrics
        m.generation_tokens.inc(len(results))
        m.time_to_first_token.observe_many(ttft)
        m.request_queue_time.observe_many(queue)
        m.inter_token_latency.observe_many(itl)
        outputs = failed
        for pid in touched:
            if pid not in self._num_seqs:
                continue
            if final_only and not proc.is_finished(pid):
                continue
            o = proc.output(pid)
            if o.finished:
                del self._num_seqs[pid]
                m.request_finished(o.outputs[0].finish_reason or "stop")
                m.e2e_request_latency.observe(now - o.metrics["arrival_time"])
            outputs.append(o)
        m.update_pool(self.stats())
        return outputs
