"""The engine core's side of constrained decoding: one GrammarMatcher per sequence, the
token bitmask of each step, and the tokens each matcher accepts.

A step's mask must come from a matcher that has taken every token sampled so far, so a
constrained sequence never has a token in flight when its next step is laid out (the
core reads each step before scheduling the next while any constrained sequence is live,
as it does for penalties). The mask travels with the step as a numpy array (plain data,
picklable for workers in other processes); the runner applies it to the logits before
sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.structured_output.compiler import GrammarCompiler


@dataclass
class StepBitmask:
    """The masks of one step: row i is for `request_ids[i]` (its next token's allowed
    ids, one bit each, as xgrammar packs them: int32 words, little-endian bit order). A
    request that verifies speculative drafts has 1 + drafts rows, in position order."""

    request_ids: list[str]
    bitmask: np.ndarray  # [len(request_ids), ceil(vocab / 32)] int32


class SequenceGrammars:
    """Matchers of the live constrained sequences, by sequence id."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self._matchers: dict[str, object] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def new_matcher(self, compiled, eos_token_ids: list[int]):
        """A matcher of a compiled constraint, at its start (the prompt is never
        constrained). It ends on the request's own end-of-sequence ids, so that the token
        that completes the grammar is one the scheduler stops on."""
        import xgrammar

        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(eos_token_ids) or None)

    def add(self, request_id: str, matcher) -> None:
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def bitmask(self, request_ids: list[str],
                drafts: dict[str, list[int]] | None = None) -> StepBitmask | None:
        """The masks of those of `request_ids` that are constrained (None: none is).

        A request with speculative `drafts` gets a row per verified position: the mask
        after its tokens so far, then after each draft in turn. The matcher takes the
        drafts tentatively and is rolled back after; from the first draft the grammar
        refuses on, the rows allow everything: that draft is rejected by the row before
        (whose mask excludes it), so the rows after it are never emitted."""
        import xgrammar

        ids = [r for r in request_ids if r in self._matchers]
        if not ids:
            return None
        drafts = drafts or {}
        rows = [rid for rid in ids for _ in range(1 + len(drafts.get(rid, ())))]
        mask = xgrammar.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        i = 0
        for rid in ids:
            m = self._matchers[rid]
            m.fill_next_token_bitmask(mask, i)
            i += 1
            taken = 0
            for d in drafts.get(rid, ()):
                if m.is_terminated() or not m.accept_token(d):
                    break
                taken += 1
                m.fill_next_token_bitmask(mask, i)
                i += 1
            if taken:
                m.rollback(taken)
            i += len(drafts.get(rid, ())) - taken  # rows left all-ones
        return StepBitmask(rows, mask.numpy())

    def accept(self, request_id: str, token: int) -> tuple[bool, bool]:
        """Advance a sequence's matcher by its new token: (accepted, terminated). A token
        the mask allowed is always accepted; terminated means the constraint is complete
        and its end-of-sequence token was taken, so the sequence must end here."""
        m = self._matchers[request_id]
        ok = m.accept_token(token)
        return ok, m.is_terminated()
