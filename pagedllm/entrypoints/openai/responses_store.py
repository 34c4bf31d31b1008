"""Stored responses of the Responses API (`store`, `previous_response_id`, GET/DELETE).

In memory only, and bounded twice, so that a long-running server holds a known amount:
by count (`--responses-store-max`) and by bytes (each entry's JSON size). The least
recently used entry goes first (reading a response, or continuing from it, counts as a
use). An evicted response is simply unknown afterwards: a 404, as for an id never issued.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 2**20


@dataclass
class StoredResponse:
    """`response`: the Response object as sent; `conversation`: the chat messages that
    led to it (its input, with those of the responses before it), which a response that
    continues from this one starts with."""

    response: dict
    conversation: list[dict]
    size: int = 0


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the responses store bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, response: dict, conversation: list[dict]) -> bool:
        """Keep a response (evicting the least recently used ones past the bounds); False
        when it alone is larger than the whole store allows."""
        entry = StoredResponse(response, conversation)
        entry.size = len(msgspec.json.encode([response, conversation]))
        self.delete(response_id)
        if entry.size > self.max_bytes or self.max_responses == 0:
            return False
        self._entries[response_id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
