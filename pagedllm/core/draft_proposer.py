"""The scheduler's side of draft-model speculation: how many drafts, not which.

The draft model runs on the worker (worker/draft_runner.py), which fills the reserved
slots before the target's forward pass. Here the scheduler decides, with the same gates as
n-gram (batch size, each request's recent acceptance), how many slots to reserve: the
proposal is `k` placeholders, which also make the scheduler allocate the KV slots the
draft's chain writes.
"""

from __future__ import annotations

from pagedllm.core.ngram_proposer import NgramProposer

PLACEHOLDER = -1  # replaced by the worker before any forward pass reads it


class DraftModelProposer(NgramProposer):
    def __init__(self, num_speculative_tokens: int, max_batch_size: int = 32,
                 min_acceptance_rate: float = 0.2):
        super().__init__(num_speculative_tokens, 1, 1, max_batch_size, min_acceptance_rate)

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        return [PLACEHOLDER] * self.room(request_id, k)
