"""KV-aware routing: send a request where its prefix already is.

The router hashes the prompt's full blocks with the same chain the workers
use (engine/hashing.py), asks the block index how many leading blocks each
worker holds, and scores workers by

    cached prefix blocks - load_weight_blocks * requests in flight

A stale index entry can only make a worker look better than it is: the
worker's own prefix cache decides what is reused, so the cost is a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.hashing import BlockHash, hash_blocks
from engine.index import BlockIndex
from router.policies import RoutingPolicy
from router.pool_manager import WorkerHandle


@dataclass(frozen=True)
class RoutePlan:
    prefill: WorkerHandle | None  # None: the decode worker prefills the prompt itself
    decode: WorkerHandle
    decode_cached_blocks: int  # the index's count of the prompt's blocks on `decode`
    hashes: list[BlockHash]  # of the prompt's full blocks


class PrefixRouter:
    def __init__(
        self,
        index: BlockIndex,
        block_size: int,
        root: BlockHash,
        fallback: RoutingPolicy,
        *,
        enabled: bool = True,
        load_weight_blocks: float = 4.0,
        local_prefill_tokens: int = 256,
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.root = root
        self.fallback = fallback
        self.enabled = enabled
        self.load_weight = load_weight_blocks
        self.local_prefill_tokens = local_prefill_tokens

    def plan(
        self,
        prompt: Sequence[int],
        prefill: Sequence[WorkerHandle],
        decode: Sequence[WorkerHandle],
        colocated: bool,
    ) -> RoutePlan:
        hashes = hash_blocks(prompt, self.block_size, self.root)
        cached = self.index.lookup(hashes) if self.enabled and self.index.healthy else {}
        d = self._best(decode, cached)
        d_blocks = cached.get(d.name, 0)
        uncached = len(prompt) - d_blocks * self.block_size
        local = colocated or (
            d_blocks > 0 and self.local_prefill_tokens > 0 and uncached <= self.local_prefill_tokens
        )
        p = None if local else self._best(prefill, cached)
        return RoutePlan(p, d, d_blocks, hashes)

    def _best(self, workers: Sequence[WorkerHandle], cached: dict[str, int]) -> WorkerHandle:
        if not cached:
            return self.fallback.pick(workers)
        scores = {w: cached.get(w.name, 0) - self.load_weight * w.in_flight for w in workers}
        top = max(scores.values())
        return self.fallback.pick([w for w in workers if scores[w] == top])
