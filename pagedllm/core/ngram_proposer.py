"""n-gram (prompt lookup) proposals for speculative decoding.

A request whose text repeats itself (code edits, quoting, extraction, "repeat after me")
has its next tokens written out earlier in its own history. The proposer finds the
longest suffix of the history (between `prompt_lookup_min` and `prompt_lookup_max`
tokens) that occurred before, and proposes the tokens that followed that occurrence; the
target model then checks them all in one forward pass (worker/model_runner.py), so an
accepted draft is a token gained for the price of a slot in a step.

Pure Python so that the core stays importable without numpy: the search runs in C as
`bytes.rfind` over the token ids packed four bytes each, which scans thousands of tokens
in microseconds.

Dynamic speculation: a request whose recent drafts were mostly rejected proposes nothing
(its EWMA acceptance below `min_acceptance_rate`; it probes again every `PROBE_EVERY`
steps so that a request that turns repetitive later is noticed), and so does every
request while more than `max_batch_size` decode together: a full batch is compute bound,
where every rejected draft costs as much as a real token.
"""

from __future__ import annotations

from pagedllm.core.token_array import as_token_array

EWMA_WEIGHT = 0.3  # weight of the newest step in a request's acceptance rate
PROBE_EVERY = 8  # steps a request with a low acceptance rate waits before trying again


def find_ngram_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to `k` tokens that followed the most recent earlier occurrence of the
    longest suffix of `tokens` of length min_n..max_n; [] when none occurred."""
    total = len(tokens)
    if total < min_n + 1 or k < 1:
        return []
    # Only the last max_n tokens are needed as a pattern; the haystack excludes the final
    # token so that a match always has at least one following token.
    ids = as_token_array(tokens)  # a request's own ids are such an array already
    width = ids.itemsize  # bytes an id (token_array.TYPECODE's)
    packed = ids.tobytes()
    hay_end = (total - 1) * width
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        pat = packed[(total - n) * width :]
        end = hay_end
        while True:
            at = packed.rfind(pat, 0, end)
            if at < 0:
                break
            if at % width == 0:  # token aligned, not a match straddling two ids
                start = at // width + n
                return list(tokens[start : start + k])
            end = at + len(pat) - 1  # look again, ending before this unaligned hit
    return []


class NgramProposer:
    """Drafts for each decoding request, and the acceptance bookkeeping that gates them."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_batch_size: int = 32, min_acceptance_rate: float = 0.2):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_batch_size = max_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self._rate: dict[str, float] = {}  # request id -> EWMA of its accepted fraction
        self._idle: dict[str, int] = {}  # request id -> steps since its rate went low

    def enabled_for_batch(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch_size

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to min(k, num_speculative_tokens) draft tokens for one request."""
        k = self.room(request_id, k)
        return find_ngram_draft(tokens, self.min_n, self.max_n, k) if k else []

    def room(self, request_id: str, k: int) -> int:
        """Drafts this request may get now: 0 while its acceptance rate is low (but for a
        probe every PROBE_EVERY steps), else min(k, num_speculative_tokens)."""
        k = min(k, self.k)
        if k < 1:
            return 0
        if self._rate.get(request_id, 1.0) < self.min_acceptance_rate:
            idle = self._idle.get(request_id, 0) + 1
            if idle < PROBE_EVERY:
                self._idle[request_id] = idle
                return 0
            self._idle[request_id] = 0
        return k

    def record(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        if num_draft:
            prev = self._rate.get(request_id, 1.0)
            self._rate[request_id] = (1 - EWMA_WEIGHT) * prev + EWMA_WEIGHT * num_accepted / num_draft

    def forget(self, request_id: str) -> None:
        self._rate.pop(request_id, None)
        self._idle.pop(request_id, None)
