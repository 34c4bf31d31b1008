"""Applying a step's token bitmask to the logits on the device (CPU or CUDA)."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: torch.Tensor | list[int] | None) -> None:
    """Set to -inf, in place, the logits of `rows` whose token's bit is 0 in that row of
    `bitmask` ([logits rows, ceil(vocab / 32)] int32, on the logits' device). Rows not
    listed are left alone, so unconstrained sequences of the batch cost nothing; None
    means every row. On CUDA, `rows` should be an int32 tensor already on the device (a
    list is copied from pageable memory, which waits for all queued work).

    Runs eagerly, after a CUDA graph's replay, on logits the graph does not own."""
    import xgrammar

    vocab = min(logits.shape[-1], bitmask.shape[-1] * 32)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
