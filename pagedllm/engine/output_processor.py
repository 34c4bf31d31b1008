"""Token ids -> what users read: text (incrementally detokenized), stop strings, logprobs.

A user request with n > 1 is run as n sequences; this is where they are gathered back into
one RequestOutput. Text that might be the start of a stop string is held back until it is
known not to be one, so a streamed response never shows a stop string it was asked to cut.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizers import IncrementalDetokenizer


@dataclass
class _Seq:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

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


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self._token_text: dict[int, str] = {}
        self.seq_owner: dict[str, tuple[str, int]] = {}  # sequence id -> (request id, index)

    def parent_id(self, seq_id: str) -> tuple[str, int]:
        return self.seq_owner[seq_id]

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: list[SamplingParams]) -> None:
        seqs = []
        for i, p in enumerate(params):
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p.skip_special_tokens)
            seqs.append(_Seq(i, p, detok, logprobs=[] if p.logprobs is not None else None))
        for i in range(len(params)):
            self.seq_owner[child_id(request_id, i, len(params))] = (request_id, i)
        parent = _Parent(request_id, prompt, prompt_token_ids, seqs, time.monotonic())
        if params[0].prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self.parents[request_id] = parent

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position(self, entry: tuple[list[int], list[float], list[int]]) -> PositionLogprobs:
        ids, lps, ranks = entry
        pos: PositionLogprobs = {}
        for t, lp, r in zip(ids, lps, ranks, strict=True):
            if t not in pos:
                pos[t] = Logprob(lp, r, self.token_text(t))
        return pos

    def add_prompt_logprobs(self, seq_id: str, entries) -> None:
        parent = self.parents.get(self.seq_owner.get(seq_id, ('', 0))[0])
        if parent is not None and parent.prompt_logprobs is not None:
            parent.prompt_logprobs.extend(self._position(e) for e in entries)

    def add_token(self, seq_id: str, token: int, logprobs, finish_reason: str | None,
                  stop_reason) -> str | None:
        """Record one new token. Returns the stop string if one now ends the sequence."""
        pid, idx = self.seq_owner[seq_id]
        parent = self.parents[pid]
        if parent.first_token_time is None:
            parent.first_token_time = time.monotonic()
        seq = parent.seqs[idx]
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[1][0]
            if seq.logprobs is not None:
                seq.logprobs.append(self._position(logprobs))
        hit = None
        if seq.detok is not None:
            before = len(seq.text)
            # An eos / stop token ends the text without appearing in it (vLLM's rule).
            stopped_by_token = finish_reason == "stop" and not isinstance(stop_reason, str)
            if not stopped_by_token or seq.params.include_stop_str_in_output:
                seq.text += seq.detok.add(token)
            if seq.params.stop and finish_reason is None:
                hit = self._find_stop(seq, before)
        if hit is None and finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
        return hit

    def _find_stop(self, seq: _Seq, before: int) -> str | None:
        best = None
        for s in seq.params.stop:
            i = seq.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason, seq.stop_reason = "stop", s
        return s

    def set_cached_tokens(self, seq_id: str, n: int) -> None:
        pid, idx = self.seq_owner.get(seq_id, ("", -1))
        if idx == 0 and pid in self.parents:
            self.parents[pid].num_cached_tokens = max(n, 0)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = reason
        return self.output(request_id)

    def is_finished(self, request_id: str) -> bool:
        return all(s.finish_reason is not None for s in self.parents[request_id].seqs)

    def output(self, request_id: str) -> RequestOutput:
        parent = self.parents[request_id]
        outs = []
        for seq in parent.seqs:
            text = seq.text
            if seq.finish_reason is None and seq.holdback:
                text = text[: max(0, len(text) - seq.holdback)]
            outs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        finished = all(o.finish_reason is not None for o in outs)
        metrics = {"arrival_time": parent.arrival}
        if parent.first_token_time is not None:
            metrics["first_token_time"] = parent.first_token_time
        if finished:
            self.parents.pop(request_id)
            for i in range(len(parent.seqs)):
                self.seq_owner.pop(child_id(request_id, i, len(parent.seqs)), None)
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(
            request_id=request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, outputs=outs, finished=finished,
            prompt_logprobs=parent.prompt_logprobs, num_cached_tokens=parent.num_cached_tokens,
            metrics=metrics,
        )
