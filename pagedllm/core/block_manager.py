"""The page pool: which KV-cache block belongs to which request, and which can be reused.

Every layer's cache has `num_blocks` blocks of `block_size` token slots; one block id
addresses the same slot range in every layer, so one block table per request suffices.

Prefix sharing: a *full* block is identified by a hash of (parent block hash, its token
ids); the first block's parent is the root of the request's LoRA adapter (the base model's
root for none), so KV computed under one adapter is never shared with another. Such blocks are registered in `cached`; a new request whose prompt starts with the
same tokens takes those blocks (ref count + 1) instead of computing them again. A block
whose ref count drops to zero goes to the free queue but keeps its hash, so a later
request can still hit it, until the pool needs the slot (least recently freed goes first).

A request's block table only grows while it holds blocks: `allocate_slots` appends (cache
hits first, at admission, then fresh blocks) and `free` drops the whole table. No entry is
ever replaced in place (there is no sliding-window freeing of old blocks), which is what
lets the scheduler send workers only the ids appended since a request's previous step; a
change that recycles blocks inside a live table must send workers a full table instead.
The one exception is `trim` (speculative decoding gives back the blocks it took for
rejected drafts): the scheduler then sends that request's whole table again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from pagedllm.core.request import Request

_ROOT_HASH = b"pagedllm-root"


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_hash(lora_int_id: int) -> bytes:
    """The parent of a request's first block: one root per adapter (0: the base model)."""
    return _ROOT_HASH if not lora_int_id else hash_block(_ROOT_HASH + b"lora", [lora_int_id])


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks in eviction order: head is evicted first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (free cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing
    def _update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[i - 1] if i else root_hash(req.lora_int_id)
            hashes.append(hash_block(parent, req.tokens(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of `req` as (block ids, number of tokens).

        At least one token is always left to compute, because the step that computes it
        is the one that produces the next token's logits.
        """
        if not self.enable_prefix_caching or req.skip_prefix_cache:
            return [], 0
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    # ------------------------------------------------------------------ allocation
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of `req` (after its computed ones and
        any prefix-cache hits). Returns False, changing nothing, if the pool is too small."""
        table = self.tables.get(req.request_id, [])
        if not computed_blocks and req.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
            return True  # fits the blocks it holds: the common decode step, kept cheap
        computed_blocks = computed_blocks or []
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(table) - len(computed_blocks)
        # Hits sitting in the free queue stop being free once we take them.
        free_hits = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if need > len(self.free_queue) - free_hits:
            return False
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
            table.append(b)
        for _ in range(max(need, 0)):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:  # evict: the slot is about to hold other tokens
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            table.append(b)
        self.tables[req.request_id] = table
        if computed_blocks:
            self._num_hashed[req.request_id] = len(computed_blocks)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks of `req` that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        # Only tokens whose ids are known can be hashed (a step in flight may have computed
        # more); their KV is written by steps that run before any step that could read it.
        n_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        start = self._num_hashed.get(req.request_id, 0)
        if n_full <= start:
            return
        self._update_hashes(req)
        table = self.tables[req.request_id]
        for i in range(start, n_full):
            b, h = table[i], req.block_hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        self._num_hashed[req.request_id] = n_full

    def trim(self, req: Request, num_tokens: int) -> bool:
        """Return the blocks of `req` past its first `num_tokens` tokens (those held only
        for rejected speculative tokens). They hold no hash (only computed tokens' full
        blocks are hashed) and go first in the eviction order. True if the table shrank:
        the caller must then send workers a whole table again."""
        table = self.tables.get(req.request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return False
        for b in reversed(table[keep:]):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                self.free_queue.move_to_end(b, last=False)
        del table[keep:]
        return True

    def free(self, req: Request) -> None:
        """Return a request's blocks. Tail blocks are queued for eviction before the prefix
        blocks that other requests are likelier to share; unhashed blocks go first of all."""
        table = self.tables.pop(req.request_id, [])
        self._num_hashed.pop(req.request_id, None)
        for b in reversed(table):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no request holds blocks."""
        if len(self.free_queue) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True
