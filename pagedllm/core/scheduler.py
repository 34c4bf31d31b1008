"""Continuous batching: each step decides how many tokens every request runs.

Policy (vLLM V1's): running requests first (decodes and unfinished prefill chunks), then
waiting requests in arrival order, all under one token budget (`max_num_batched_tokens`)
and a cap on running sequences (`max_num_seqs`). A prompt that does not fit the remaining
budget is chunked. When the page pool runs dry the newest running request is preempted:
its blocks are freed and it is recomputed later (prefix caching makes that cheap), or,
with a swap space (`swap_blocks`), its pages are copied out to host memory and back when it
resumes, so that a long sequence is not read again: the step carries the copies
(SchedulerOutput.swap_out / swap_in) and each worker makes them before its forward.

One prompt is read at a time (vLLM's `max_num_partial_prefills` of 1): a waiting request is
admitted only into budget that the one before it left, so the running list holds at most
one unfinished prompt, the newest, and every decode comes before it in a step. While any
decode runs, the prompt tokens of a step stay within `max_prefill_tokens_with_decodes`: a
step's time grows with the prompt tokens it carries, and each step is one more token for
every running stream, so a 32k prompt arriving among 64 streams is read in chunks of that
size instead of stalling all 64 for whole-budget steps. With no decode running the whole
budget goes to the prompt (a lone long prompt is read at full speed). The cap is at least
one token, so a prompt moves on in every step whose budget exceeds its decodes (the
defaults' budgets are several times `max_num_seqs`).

The output is plain data so it can be sent to worker processes unchanged. It is a delta:
a request's sampling state travels once (NewRequestData), its block table once per
admission (the first chunk after it is admitted or resumed), and each later chunk carries
only the block ids appended since the request's previous chunk. Workers keep the rest.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.block_manager import KVCacheManager
from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.token_array import token_array


@dataclass
class NewRequestData:
    """Sent once per request so workers can keep its sampling state (also across a
    preemption: a seeded generator and the prompt logprobs already reported carry on)."""

    request_id: str
    prompt_token_ids: array  # the core's own (never changed); arrays pickle compactly
    output_token_ids: array
    sampling_params: Any
    lora_request: Any = None  # the worker loads its adapter into a slot


@dataclass
class ScheduledChunk:
    """Tokens of one request to compute this step, and the blocks its worker-side table
    lacks. The worker keeps each request's table (worker/block_table.py): `new_block_ids`
    are the ids appended since the request's previous chunk (usually none in a decode
    step, one when it crosses a block boundary) or, with `full_table`, its whole table, on
    the first chunk after the request was admitted or resumed from a preemption (prefix
    cache hits included); the worker then drops any table it kept for it."""

    request_id: str
    start: int  # position of the first token to compute (= tokens already in the cache)
    num_tokens: int
    new_block_ids: list[int]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    full_table: bool = False
    # Speculative decoding: tokens proposed after the request's last one, computed in this
    # chunk behind it (num_tokens = 1 + len(draft_token_ids)) and verified by the worker.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    # Constrained decoding: the token bitmask of the sequences of this step that sample
    # under a grammar (filled in by the engine core after scheduling; a
    # pagedllm.structured_output.StepBitmask, opaque here). None: no row is constrained.
    grammar_bitmask: Any = None
    # Swapped preemption: (device block ids, first host block) to copy out, then (first
    # host block, device block ids) to copy in, before the step's forward (in that order:
    # a block freed by one may be written by the other).
    swap_out: list[tuple[list[int], int]] = field(default_factory=list)
    swap_in: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class HostBlocks:
    """The swap space's blocks: each preempted sequence takes one contiguous run of them
    (its pages go over in one copy each way), first fit over the free runs."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[tuple[int, int]] = [(0, num_blocks)] if num_blocks else []  # (start, length)

    @property
    def num_free(self) -> int:
        return sum(n for _, n in self._free)

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                self._free[i] = (start + n, length - n)
                if length == n:
                    del self._free[i]
                return start
        return None

    def free(self, start: int, n: int) -> None:
        runs = sorted(self._free + [(start, n)])
        merged: list[tuple[int, int]] = []
        for s, length in runs:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                assert not merged or merged[-1][0] + merged[-1][1] < s, "host blocks freed twice"
                merged.append((s, length))
        self._free = merged


# Sequences with fewer computed tokens than this are recomputed, not swapped: reading a
# short context again costs less than two copies over the bus and the host space it holds.
SWAP_MIN_TOKENS = 256


@dataclass
class FinishedInfo:
    request: Request
    new_token: int | None


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_prefill_tokens_with_decodes: int = 0,
        proposer: NgramProposer | None = None,
        max_loras: int = 0,
        swap_blocks: int = 0,
    ):
        self.kv = kv
        # Host blocks for preempted sequences' pages (0: preemption recomputes).
        self.host = HostBlocks(swap_blocks) if swap_blocks > 0 else None
        self._carry_swap_out: list[tuple[list[int], int]] = []  # of a step with no chunk
        self.num_swapped_out_total = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # Prompt tokens a step may compute while decodes run; 0: no cap beyond the budget.
        if max_prefill_tokens_with_decodes < 0:
            raise ValueError("max_prefill_tokens_with_decodes must be >= 0 (0: no cap), got "
                             f"{max_prefill_tokens_with_decodes}")
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        # Set by the engine core from its step times (core/prefill_pacer.py): a tighter cap
        # on the prompt tokens of a step beside decodes (0: none this step). None: the
        # fixed cap alone.
        self.prefill_chunk_hint: int | None = None
        # Multi-LoRA: the running requests use at most this many adapters together, the
        # workers' slots (0: LoRA off). A waiting request of another adapter waits, and
        # the requests behind it may go first.
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._sent_to_worker: set[str] = set()
        # Block ids of each admitted request's table that the workers hold; dropped when
        # its blocks are freed (preemption, finish), so its next chunk sends a full table.
        self._blocks_sent: dict[str, int] = {}
        self.num_preemptions_total = 0
        # Speculative decoding: drafts are proposed here, from the tokens on the host, and
        # the acceptance counts kept for the metrics (per draft position too).
        self.proposer = proposer
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = [0] * (proposer.k if proposer else 0)

    # ------------------------------------------------------------------ admission
    def max_request_tokens(self) -> int:
        return min(self.max_model_len, self.kv.num_blocks * self.kv.block_size)

    def add_request(self, req: Request) -> None:
        """Queue a request; raise ValueError for one that can never fit."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt must contain at least one token")
        if req.num_prompt_tokens > self.max_model_len - (0 if req.pooling else 1):
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens; this model's maximum context "
                f"length is {self.max_model_len} including at least one generated token"
            )
        pool_tokens = self.kv.num_blocks * self.kv.block_size
        need = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len)
        if need > pool_tokens:
            raise ValueError(
                f"the request needs {need} tokens of KV cache (prompt {req.num_prompt_tokens} + "
                f"max_tokens {req.max_tokens}) but the whole pool holds {pool_tokens}"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now for a reason found outside the token-level stop rules (an
        abort; a grammar that is complete): its blocks are freed at once."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._remove(req)
        self._finish(req, status)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling
    def _swap_out(self, req: Request, out: SchedulerOutput) -> None:
        """Keep a preempted request's computed pages in the swap space when they are worth
        it and fit (else it is recomputed): the copy goes with this step."""
        computed = req.num_computed_tokens
        if self.host is None or computed < SWAP_MIN_TOKENS:
            return
        n = self.kv.blocks_needed(computed)
        start = self.host.alloc(n)
        if start is None:
            return
        out.swap_out.append((list(self.kv.block_table(req.request_id)[:n]), start))
        req.swapped = (start, n, computed)
        self.num_swapped_out_total += 1

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._swap_out(req, out)
        self.kv.free(req)
        self._blocks_sent.pop(req.request_id, None)  # the worker's copy is replaced on resumption
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def _to_compute(self, req: Request) -> int:
        """Tokens a running request could compute now: its known tokens not yet in the
        cache, plus the ones sampled by steps in flight; 0 when its last token is in flight."""
        end = req.num_tokens + req.num_pending  # pending tokens can be computed already
        if req.num_pending and (req.num_output_tokens + req.num_pending >= req.max_tokens
                                or end >= self.max_model_len):
            return 0
        return end - req.num_computed_tokens

    @staticmethod
    def _prefilling(req: Request) -> bool:
        """Reading tokens it already had: its prompt, or after a preemption its prompt and
        all but the last of its outputs again. A decode computes only what it sampled."""
        return (req.num_computed_tokens < req.num_prompt_tokens
                or req.num_computed_tokens + 1 < req.num_tokens)

    def may_speculate(self) -> bool:
        """Whether the next step may propose drafts (the proposer's batch gate is open).
        Drafts need every sampled token on the host, so with async scheduling the core
        reads the step in flight before scheduling such a step, and overlaps otherwise."""
        return self.proposer is not None and self.proposer.enabled_for_batch(
            sum(1 for r in self.running if not self._prefilling(r)))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids, swap_out=self._carry_swap_out)
        self._finished_ids = []
        self._carry_swap_out = []
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        # Prompt tokens this step may still take: the cap if any sequence decodes in it.
        cap = self.max_prefill_tokens_with_decodes or None
        if self.prefill_chunk_hint is not None:
            cap = self.prefill_chunk_hint if cap is None else min(cap, self.prefill_chunk_hint)
        decoding = any(not self._prefilling(r) and self._to_compute(r) for r in self.running)
        prefill_left = cap if cap is not None and decoding else budget

        speculate = self.may_speculate()
        drafts: dict[str, list[int]] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = self._to_compute(req)
            if want == 0:
                i += 1  # its last token is in flight: nothing left to compute
                continue
            prefill = self._prefilling(req)
            if speculate and not prefill and want == 1 and not req.num_pending and req.allow_spec:
                # Room for the drafts: every one accepted plus the bonus token must stay
                # within max_tokens, the context and this step's budget.
                room = min(req.max_tokens - req.num_output_tokens,
                           self.max_model_len - req.num_tokens, budget) - 1
                draft = self.proposer.propose(req.request_id, req.tokens(0, req.num_tokens), room)
                if draft:
                    drafts[req.request_id] = draft
                    want += len(draft)
            n = min(want, budget, prefill_left if prefill else budget)
            if n == 0:  # a prompt the step has no room left for: its next chunk waits
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                out.num_preemptions += 1
                drafts.pop(victim.request_id, None)
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                if prefill:
                    prefill_left -= n
                i += 1

        if out.num_preemptions == 0:
            loras = {r.lora_int_id for r in self.running if r.lora_int_id}
            held_back: list[Request] = []
            while (self.waiting and budget > 0 and prefill_left > 0
                   and len(self.running) < self.max_num_seqs):
                req = self.waiting[0]
                if req.num_pending:
                    break  # preempted with a token in flight: its prefill needs that token's id
                if req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.max_loras:
                    held_back.append(self.waiting.popleft())  # every slot is taken
                    continue
                if req.whole_prompt and req.num_tokens > min(budget, prefill_left):
                    break  # it waits for a step with room for all of it (in order)
                if req.swapped is not None:  # its pages come back from the swap space
                    start, nblocks, num_hit_tokens = req.swapped
                    hits = []
                    req.num_computed_tokens = num_hit_tokens  # what allocate_slots counts from
                else:
                    hits, num_hit_tokens = self.kv.get_computed_blocks(req)
                n = min(req.num_tokens - num_hit_tokens, budget, prefill_left)
                if not self.kv.allocate_slots(req, n, hits):
                    req.num_computed_tokens = 0
                    break
                if req.swapped is not None:
                    out.swap_in.append((start, list(self.kv.block_table(req.request_id)[:nblocks])))
                    self.host.free(start, nblocks)  # reused only by copies queued after this one
                    req.swapped = None
                self.waiting.popleft()
                if req.lora_int_id:
                    loras.add(req.lora_int_id)
                req.num_computed_tokens = num_hit_tokens
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit_tokens
                    req.first_scheduled_time = time.monotonic()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                scheduled.append((req, n))
                budget -= n
                prefill_left -= n
            self.waiting.extendleft(reversed(held_back))

        for req, n in scheduled:
            if req.request_id not in self._sent_to_worker:
                self._sent_to_worker.add(req.request_id)
                out.new_requests.append(
                    NewRequestData(
                        req.request_id,
                        req.prompt_token_ids,
                        token_array(req.output_token_ids),  # a copy: the core appends to its own
                        req.sampling_params,
                        req.lora_request,
                    )
                )
            draft = drafts.get(req.request_id, [])
            sample = req.num_computed_tokens + n - len(draft) == req.num_tokens + req.num_pending
            table = self.kv.block_table(req.request_id)
            sent = self._blocks_sent.get(req.request_id)
            # Tables only grow while blocks are held (KVCacheManager), so ids the worker
            # has stay valid; a shorter table would mean an earlier entry changed.
            assert sent is None or len(table) >= sent, "a block table shrank while held"
            self._blocks_sent[req.request_id] = len(table)
            out.chunks.append(
                ScheduledChunk(
                    req.request_id,
                    req.num_computed_tokens,
                    n,
                    table[sent or 0 :],  # a copy: the table grows in later steps
                    sample,
                    full_table=sent is None,
                    draft_token_ids=draft,
                )
            )
            # Advanced now, so that the next step can be scheduled before this one returns.
            req.num_computed_tokens += n
            if sample:
                req.num_pending += 1
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if out.is_empty and out.swap_out:  # nothing runs this step: the copies go with the next
            self._carry_swap_out, out.swap_out = out.swap_out, []
        return out

    # ------------------------------------------------------------------ results
    def update(self, out: SchedulerOutput,
               sampled: dict[str, int | list[int]]) -> list[tuple[Request, int | None]]:
        """Take in what a step sampled: append the tokens and apply token-level stop rules.
        Returns (request, new token) for each token a request got, in order: a chunk with
        drafts yields a list (its accepted drafts and the token after them); tokens past a
        stop are dropped, and the KV of rejected drafts is given up (`_roll_back`).

        With async scheduling a later step may already be scheduled (or running) when this
        is called: a request that stops here computed one token too many there, which is
        simply never read. A request preempted after this step was scheduled keeps its
        token (it was computed from a valid context). A pooling request's last chunk
        samples nothing: the engine core ends it once its vector is read."""
        results: list[tuple[Request, int | None]] = []
        for chunk in out.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.is_finished:
                continue  # aborted or stopped while the step ran
            if not chunk.sample:  # a prefill chunk short of the prompt's end still fills blocks
                if req.status == RequestStatus.RUNNING:
                    self.kv.cache_full_blocks(req)
                continue
            req.num_pending -= 1
            got = sampled.get(chunk.request_id)
            if got is None:
                continue  # failed alone: the engine aborts it
            tokens = got if isinstance(got, list) else [got]
            if chunk.draft_token_ids:
                self._roll_back(req, chunk, len(tokens) - 1)
            status = None
            for token in tokens:
                req.output_token_ids.append(token)
                results.append((req, token))
                status = self._check_stop(req, token)
                if status is not None:
                    break  # tokens past a stop (or max_tokens) are dropped
            if req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)
            if status is not None:
                self._remove(req)
                self._finish(req, status)
        return results

    def _roll_back(self, req: Request, chunk: ScheduledChunk, num_accepted: int) -> None:
        """Count a verified chunk's drafts, and forget the KV of the rejected ones: the
        computed tokens end after the accepted drafts (so a block holding a rejected token
        is never hashed: `cache_full_blocks` hashes computed tokens only, and the slot is
        overwritten by the next step), and blocks past them go back to the pool."""
        d = len(chunk.draft_token_ids)
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += d
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1
        self.proposer.record(req.request_id, d, num_accepted)
        if req.status != RequestStatus.RUNNING or d == num_accepted:
            return
        req.num_computed_tokens -= d - num_accepted
        if self.kv.trim(req, req.num_computed_tokens):
            # The worker's copy of the table is longer: send a whole one next time.
            self._blocks_sent.pop(req.request_id, None)

    def _remove(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        n_out = req.num_output_tokens
        if n_out >= req.min_tokens:
            if not req.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req.swapped is not None:  # ended while swapped out (aborted, or its last token came)
            self.host.free(req.swapped[0], req.swapped[1])
            req.swapped = None
        if self.proposer is not None:
            self.proposer.forget(req.request_id)
        self.kv.free(req)
        self._blocks_sent.pop(req.request_id, None)
        if req.request_id in self._sent_to_worker:
            self._sent_to_worker.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request once its output has been delivered."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
