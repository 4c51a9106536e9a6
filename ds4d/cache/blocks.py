"""KV block accounting and the in-pool prefix index.  Plain Python, no tensors.

The model owns the KV pool tensors; this module only decides which block ids a
sequence uses.  A block is *free* (ref count 0, no content worth keeping),
*used* (ref count > 0) or *cached* (ref count 0 but holding a full, hashed
block that a later prompt may reuse; evicted least-recently-used first).

Prefix hashing: block ``i`` of a sequence has key ``H(key[i-1] || namespace ||
token ids of block i)`` with SHA-256, where the namespace carries the model
compatibility hash and the request's cache salt, so different salts never share
blocks.  Every hit is verified against the stored token ids, so a hash
collision can never produce wrong output.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def block_keys(token_ids: Sequence[int], block_size: int, namespace: bytes, parent: bytes = b"") -> list[bytes]:
    """Chained keys of every *full* block of ``token_ids``; ``parent``: the key of the block before
    the first one (the chain continued from blocks already hashed)."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(namespace)
        h.update(b",".join(str(t).encode() for t in token_ids[start:start + block_size]))
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass
class PrefixMatch:
    block_ids: list[int]
    keys: list[bytes]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockPool:
    """Block ids 0..num_blocks-1 with ref counts, a free list and an LRU of cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order: first = oldest
        self._key_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[bytes, int] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.keep_evicted = False
        """When set, evicted blocks are kept in a list for demotion (:meth:`take_evicted`)."""
        self._evicted: list[tuple[int, bytes, tuple[int, ...]]] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def has_key(self, key: bytes) -> bool:
        return key in self._block_of

    def keyed_blocks(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """(block, key, tokens) of every hashed block, in use or cached (cached ones LRU first)."""
        cached = list(self._cached)
        used = [b for b in self._key_of if self._ref[b] > 0]
        return [(b, self._key_of[b], self._tokens_of[b]) for b in [*cached, *used]]

    def take_evicted(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """(block, key, tokens) of blocks evicted since the last call, oldest first.

        The blocks already belong to new owners, whose KV has not been written yet:
        copy them out before the next forward step."""
        out, self._evicted = self._evicted, []
        return out

    # ------------------------------------------------------------------ prefix reuse

    def match(self, token_ids: Sequence[int], keys: Sequence[bytes]) -> PrefixMatch:
        """Longest run of leading blocks already in the pool with identical tokens."""
        found: list[int] = []
        if self.prefix_caching:
            bs = self.block_size
            for i, key in enumerate(keys):
                block = self._block_of.get(key)
                if block is None or self._tokens_of[block] != tuple(token_ids[i * bs:(i + 1) * bs]):
                    break
                found.append(block)
        return PrefixMatch(found, list(keys[: len(found)]))

    def acquire(self, match: PrefixMatch) -> None:
        """Take a reference on every matched block (pulling cached ones out of the LRU)."""
        for block in match.block_ids:
            if self._ref[block] == 0:
                del self._cached[block]
            self._ref[block] += 1

    def settled(self, block_id: int, key: bytes) -> bool:
        """:meth:`register` of this block under this key would change nothing."""
        return not self.prefix_caching or key in self._block_of or block_id in self._key_of

    def register(self, block_id: int, key: bytes, token_ids: Sequence[int]) -> None:
        """Record a full, computed block under its key (first writer wins)."""
        if self.settled(block_id, key):
            return
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        self._tokens_of[block_id] = tuple(token_ids)

    # ------------------------------------------------------------------ allocation

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, evicting cached ones if needed; None if impossible."""
        if count > self.num_free:
            return None
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                if self.keep_evicted:
                    self._evicted.append((block, self._key_of[block], self._tokens_of[block]))
                self._forget(block)
                self.evictions += 1
            self._ref[block] = 1
            out.append(block)
        return out

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; keyed blocks become cached, others free.

        Blocks are released in reverse so the tail of a sequence is evicted before
        its head (a head is more likely to be shared by the next request)."""
        for block in reversed(block_ids):
            self._ref[block] -= 1
            if self._ref[block] < 0:
                raise AssertionError(f"block {block} released twice")
            if self._ref[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def evict_cached(self, count: int) -> int:
        """Evict up to ``count`` cached blocks now (LRU first); how many were evicted."""
        done = 0
        while done < count and self._cached:
            block, _ = self._cached.popitem(last=False)
            if self.keep_evicted:
                self._evicted.append((block, self._key_of[block], self._tokens_of[block]))
            self._forget(block)
            self._free.append(block)
            self.evictions += 1
            done += 1
        return done

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            del self._tokens_of[block]
