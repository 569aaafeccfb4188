"""Block keys and a worker's prefix cache, as the model sees them.

A prompt's full blocks get chained keys (key j stands for the first j+1
blocks' tokens), as engine/hashing.py chains its hashes. A worker's cache
holds the keys of blocks that stay in its pool after their request: least
recently used first out, and only as many as the blocks its running
requests leave free (``capacity``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """One key per full block of ``tokens``, each chained on the one before."""
    keys: list[int] = []
    h = block_size
    for j in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[j * block_size : (j + 1) * block_size])))
        keys.append(h)
    return keys


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PrefixCache:
    """LRU of cached block keys on one worker."""

    def __init__(self, total_blocks: int) -> None:
        self.total_blocks = total_blocks
        self.in_use = 0  # blocks held by the worker's requests
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._unique = 0  # counter for blocks no prompt can match (generated tokens)

    def __len__(self) -> int:
        return len(self._lru)

    def leading(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, the cache holds."""
        n = 0
        for k in keys:
            if k not in self._lru:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[int]) -> None:
        for k in keys:
            self._lru[k] = None
            self._lru.move_to_end(k)
        self._evict()

    def store_unmatched(self, n: int) -> None:
        """Cache ``n`` blocks no later prompt will match (a request's output)."""
        for _ in range(n):
            self._unique -= 1
            self._lru[self._unique] = None
        self._evict()

    def hold(self, n: int) -> None:
        self.in_use += n
        self._evict()

    def release(self, n: int) -> None:
        self.in_use = max(0, self.in_use - n)

    def _evict(self) -> None:
        room = max(0, self.total_blocks - self.in_use)
        while len(self._lru) > room:
            self._lru.popitem(last=False)
