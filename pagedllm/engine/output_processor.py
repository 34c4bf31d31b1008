"""The core's token deltas -> what users read: text (incrementally detokenized), stop
strings, logprobs, n sequences gathered back into one RequestOutput, and the metrics.

This is the front end's half of a step. A stop string is found here, so the sequence is
ended here and its id returned for the caller to abort in the core; tokens the core made
after that (it may have run ahead) are dropped. Text that might be the start of a stop
string is held back until it is known not to be one, so a streamed response never shows a
stop string it was asked to cut.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.token_array import token_array
from pagedllm.engine.messages import EngineCoreOutput, PositionEntry, SchedulerStats
from pagedllm.engine.processor import child_id
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizers import IncrementalDetokenizer


@dataclass
class _Seq:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: array = field(default_factory=token_array)  # pagedllm/core/token_array.py
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.params.stop), default=1) - 1


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Seq]
    arrival: float
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    error: str | None = None
    embedding: list[float] | None = None  # a pooling request's vector, once it came


class OutputProcessor:
    def __init__(self, tokenizer, metrics: EngineMetrics | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.parents: dict[str, _Parent] = {}
        self._token_text: dict[int, str] = {}
        self.seq_owner: dict[str, tuple[str, int]] = {}  # sequence id -> (request id, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: list[SamplingParams], arrival: float | None = None) -> None:
        seqs = []
        for i, p in enumerate(params):
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p.skip_special_tokens)
            seqs.append(_Seq(i, p, detok, logprobs=[] if p.logprobs is not None else None))
        for i in range(len(params)):
            self.seq_owner[child_id(request_id, i, len(params))] = (request_id, i)
        parent = _Parent(request_id, prompt, prompt_token_ids, seqs,
                         time.monotonic() if arrival is None else arrival)
        if params[0].prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[request_id] = parent
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))

    def add_pooling(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: PoolingParams, arrival: float | None = None) -> None:
        """An embedding: one sequence that ends with a vector instead of tokens."""
        seq = _Seq(0, params, None)  # type: ignore[arg-type]  (never detokenized)
        self.seq_owner[request_id] = (request_id, 0)
        self.parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, [seq],
                                           time.monotonic() if arrival is None else arrival)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))

    def seq_ids(self, request_id: str) -> list[str]:
        n = len(self.parents[request_id].seqs)
        return [child_id(request_id, i, n) for i in range(n)]

    # ------------------------------------------------------------------ a step's outputs
    def process(self, outputs: list[EngineCoreOutput], stats: SchedulerStats | None = None,
                final_only: bool = False) -> tuple[list[RequestOutput], list[str]]:
        """One step's deltas -> (the RequestOutputs they changed, the sequences to abort in
        the core: those a stop string ended and the siblings of a failed one). With
        `final_only` only finished requests get an output (the offline API needs nothing
        else, and skipping the per-step copies keeps the loop lean)."""
        now = time.monotonic()
        touched: dict[str, None] = {}
        aborts: list[str] = []
        ttft: list[float] = []
        queue: list[float] = []
        itl: list[float] = []
        num_tokens = 0
        for o in outputs:
            owner = self.seq_owner.get(o.request_id)
            if owner is None:
                continue  # its request ended in the front end (abort) while the core ran on
            pid, idx = owner
            parent = self.parents[pid]
            seq = parent.seqs[idx]
            if seq.finish_reason is not None:
                continue  # ended by a stop string: the core ran ahead
            touched[pid] = None
            if o.error is not None:  # the whole request fails with its sequence
                parent.error = o.error
                for s in parent.seqs:
                    if s.finish_reason is None:
                        s.finish_reason = "error"
                aborts.extend(sid for sid in self.seq_ids(pid) if sid != o.request_id)
                continue
            if o.pooled is not None:
                parent.embedding = np.frombuffer(o.pooled, dtype="<f4").tolist()
                parent.num_cached_tokens = max(o.num_cached_tokens, 0)
                seq.finish_reason = o.finish_reason or "stop"
                continue
            if o.new_prompt_logprobs and parent.prompt_logprobs is not None:
                parent.prompt_logprobs.extend(self._position(e) for e in o.new_prompt_logprobs)
            if not o.new_token_ids:
                continue
            if seq.last_token_time is None:
                ttft.append(now - parent.arrival)
                if o.scheduled_time is not None:
                    queue.append(o.scheduled_time - parent.arrival)
                if idx == 0:
                    parent.num_cached_tokens = max(o.num_cached_tokens, 0)
            else:
                itl.append(now - seq.last_token_time)
            seq.last_token_time = now
            if parent.first_token_time is None:
                parent.first_token_time = now
            num_tokens += len(o.new_token_ids)
            last = len(o.new_token_ids) - 1
            for k, token in enumerate(o.new_token_ids):
                finish = o.finish_reason if k == last else None
                lp = o.new_logprobs[k] if o.new_logprobs is not None else None
                if self._add_token(seq, token, lp, finish, o.stop_reason if k == last else None):
                    if finish is None:  # a stop string ended it: the core must stop too
                        aborts.append(o.request_id)
                    break
        outs: list[RequestOutput] = []
        for pid in touched:
            if final_only and not self.is_finished(pid):
                continue
            outs.append(self.output(pid, now))
        m = self.metrics
        if m is not None:
            m.generation_tokens.inc(num_tokens)
            m.time_to_first_token.observe_many(ttft)
            m.request_queue_time.observe_many(queue)
            m.inter_token_latency.observe_many(itl)
            if stats is not None:
                m.update_pool(stats)
        return outs, aborts

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position(self, entry: PositionEntry) -> PositionLogprobs:
        ids, lps, ranks = entry
        pos: PositionLogprobs = {}
        for t, lp, r in zip(ids, lps, ranks, strict=True):
            if t not in pos:
                pos[t] = Logprob(lp, r, self.token_text(t))
        return pos

    def _add_token(self, seq: _Seq, token: int, logprobs: PositionEntry | None,
                   finish_reason: str | None, stop_reason: int | None) -> bool:
        """Record one new token; True if the sequence has now finished."""
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[1][0]
            if seq.logprobs is not None:
                seq.logprobs.append(self._position(logprobs))
        if seq.detok is not None:
            before = len(seq.text)
            # An eos / stop token ends the text without appearing in it (vLLM's rule).
            if finish_reason != "stop" or seq.params.include_stop_str_in_output:
                seq.text += seq.detok.add(token)
            if seq.params.stop and finish_reason is None and self._find_stop(seq, before):
                return True
        if finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
            return True
        return False

    def _find_stop(self, seq: _Seq, before: int) -> bool:
        best = None
        for s in seq.params.stop:
            i = seq.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason, seq.stop_reason = "stop", s
        return True

    # ------------------------------------------------------------------ requests
    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request in the front end (its sequences must be aborted in the core too)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
        return self.output(request_id)

    def is_finished(self, request_id: str) -> bool:
        return all(s.finish_reason is not None for s in self.parents[request_id].seqs)

    def output(self, request_id: str, now: float | None = None
               ) -> RequestOutput | EmbeddingRequestOutput:
        """The request's cumulative output; a finished request is forgotten here."""
        parent = self.parents[request_id]
        if isinstance(parent.seqs[0].params, PoolingParams):
            return self._embedding(parent, now)
        outs = []
        for seq in parent.seqs:
            text = seq.text
            if seq.finish_reason is None and seq.holdback:
                text = text[: max(0, len(text) - seq.holdback)]
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.token_ids.tolist(),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        finished = all(o.finish_reason is not None for o in outs)
        metrics = {"arrival_time": parent.arrival}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        if finished:
            now = time.monotonic() if now is None else now
            for sid in self.seq_ids(request_id):
                self.seq_owner.pop(sid, None)
            self.parents.pop(request_id)
            metrics["finished_time"] = now
            if self.metrics is not None:
                reason = "error" if parent.error is not None else outs[0].finish_reason or "stop"
                self.metrics.request_finished(reason)
                if reason not in ("abort", "error"):
                    self.metrics.e2e_request_latency.observe(now - parent.arrival)
        return RequestOutput(
            request_id=request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=outs, finished=finished,
            prompt_logprobs=parent.prompt_logprobs, num_cached_tokens=parent.num_cached_tokens,
            metrics=metrics, error=parent.error,
        )

    def _embedding(self, parent: _Parent, now: float | None) -> EmbeddingRequestOutput:
        """A pooling request's output: only ever asked for once it has finished."""
        now = time.monotonic() if now is None else now
        self.seq_owner.pop(parent.request_id, None)
        self.parents.pop(parent.request_id)
        reason = "error" if parent.error is not None else parent.seqs[0].finish_reason or "stop"
        if self.metrics is not None:
            self.metrics.request_finished(reason)
            if reason not in ("abort", "error"):
                self.metrics.e2e_request_latency.observe(now - parent.arrival)
        return EmbeddingRequestOutput(
            request_id=parent.request_id, prompt_token_ids=parent.prompt_token_ids,
            outputs=EmbeddingOutput(parent.embedding or []), finished=True,
            num_cached_tokens=parent.num_cached_tokens,
            metrics={"arrival_time": parent.arrival, "finished_time": now},
            error=parent.error)
