"""Validation of prompt token ids, on every request's path (front end and core).

A generator over the ids (`any(not isinstance(t, int) ...)`) costs about half a
microsecond a token in the interpreter: for a batch of embedding inputs (2,048 x 256
tokens) that is a quarter of a second per check, on the host, between the GPU's steps.
Here the common case (a list of plain ints) is decided by C-level passes: the set of the
elements' types, then min and max; anything else takes the exact per-token check."""

from __future__ import annotations

from collections.abc import Sequence


def token_ids_in_range(ids: Sequence, vocab: int) -> bool:
    """True when every id is an int in [0, vocab) (an empty sequence is)."""
    if len(ids) == 0:
        return True
    if set(map(type, ids)) == {int}:
        return 0 <= min(ids) and max(ids) < vocab
    return all(isinstance(t, int) and 0 <= t < vocab for t in ids)
