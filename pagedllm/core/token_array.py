"""A request's token ids, held for its lifetime as a flat array of C ints.

Python's full garbage collections visit every item of every live list. A running request
keeps its ids in several places (the core's prompt and output, the worker's history, the
front end's output ids), so at 512 sequences of 2,048 tokens a full collection walks some
three million list items: about 30 ms on this project's CPU, and such passes come every
fifty steps or so even with the startup heap frozen (pagedllm/heap.py). An `array` holds
the ids as raw 32-bit values: a pass visits the array (its type) but none of its items, and
it takes 4 bytes a token instead of a pointer to a 28-byte int object.

An array appends, extends, indexes and slices like a list (a slice is another array), and
`torch.tensor`, `list.extend` and the tokenizers take it. Two differences matter: an array
never compares equal to a list, and `+` joins only arrays of the same type; what leaves
the engine (RequestOutput, messages between processes) is turned back into lists.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

TYPECODE = "i"  # 32-bit: every vocabulary's ids fit, and they are checked against it first


def token_array(ids: Iterable[int] = ()) -> array:
    """The ids as a fresh array (a copy, also when `ids` is already one)."""
    return array(TYPECODE, ids)


def as_token_array(ids: Iterable[int]) -> array:
    """The ids as an array: `ids` itself when it is one of the right type, else a copy."""
    if isinstance(ids, array) and ids.typecode == TYPECODE:
        return ids
    return token_array(ids)
