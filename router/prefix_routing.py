"""KV-aware routing: send a request where its prefix already is.

The router hashes the prompt's full blocks with the same chain the workers
use (engine/hashing.py), asks the block index how many leading blocks each
worker holds, and scores workers by

    device blocks + host_block_weight * host-tier blocks
        - load_weight_blocks * requests in flight

where a worker's cached prefix is counted in blocks on its device and
blocks only in its second KV tier (engine/kv_tier.py; an index that keeps
no tier, Redis, counts all as device blocks). A host-tier block is worth
less than a device block: it is copied back into the pool (and its digest
checked) before the request starts, which costs a fraction of computing it
(docs/kv-tier.md has the measured figure behind the default 0.75).

A stale index entry can only make a worker look better than it is: the
worker's own prefix cache decides what is reused, so the cost is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from block_index import BlockIndex, TierCounts, TieredIndex
from engine.hashing import BlockHash, hash_blocks
from router.policies import RoutingPolicy
from router.pool_manager import WorkerHandle


@dataclass(frozen=True)
class RoutePlan:
    prefill: WorkerHandle | None  # None: the decode worker prefills the prompt itself
    decode: WorkerHandle
    decode_cached_blocks: int  # the index's count of the prompt's blocks on `decode`
    hashes: list[BlockHash]  # of the prompt's full blocks
    pull_from: WorkerHandle | None = None  # holds more of the prefix than `prefill`
    pull_hashes: list[BlockHash] = field(default_factory=list)  # what to pull from it
    predicted_tokens: int = 0
    """Prompt tokens the index predicts the prefilling worker will find cached
    (``decode`` without ``prefill``, else ``prefill``, with what it pulls): its
    leading blocks, at most the prompt's full blocks but its last token (the
    engine computes that one for the logits)."""
    available_tokens: int = 0
    """The same count for the worker of either pool the index says holds most
    of the prompt: what a perfect router could have reused."""


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
        pull_min_blocks: int = 2,
        host_block_weight: float = 0.75,
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.root = root
        self.fallback = fallback
        self.enabled = enabled
        self.load_weight = load_weight_blocks
        self.local_prefill_tokens = local_prefill_tokens
        self.pull_min_blocks = pull_min_blocks
        self.host_block_weight = host_block_weight

    def plan(
        self,
        prompt: Sequence[int],
        prefill: Sequence[WorkerHandle],
        decode: Sequence[WorkerHandle],
        colocated: bool,
        cache_salt: bytes = b"",
        fits: Callable[[WorkerHandle, int], bool] | None = None,
    ) -> RoutePlan | None:
        """``cache_salt``: the request's prefix-cache domain; its blocks'
        hashes use it, so only that domain's cached blocks count. ``fits(worker,
        cached prefix blocks)``: whether the request fits on a decode worker
        (router/admission.py); None when it fits on none."""
        use_index = self.enabled and self.index.healthy
        hashes = hash_blocks(prompt, self.block_size, self.root, cache_salt) if use_index else []
        tiers = self._lookup(hashes) if use_index else {}
        cached = {w: c.blocks for w, c in tiers.items()}
        worth = {w: c.device + self.host_block_weight * c.host for w, c in tiers.items()}
        if fits is not None:
            decode = [w for w in decode if fits(w, cached.get(w.name, 0))]
            if not decode:
                return None
        d = self._best(decode, worth)
        d_blocks = cached.get(d.name, 0)
        uncached = len(prompt) - d_blocks * self.block_size
        local = colocated or (
            d_blocks > 0 and self.local_prefill_tokens > 0 and uncached <= self.local_prefill_tokens
        )
        routable = [*prefill, *decode]
        available = self._hit(prompt, max((cached.get(w.name, 0) for w in routable), default=0))
        if local:
            hit = self._hit(prompt, d_blocks)
            return RoutePlan(
                None, d, d_blocks, hashes, predicted_tokens=hit, available_tokens=available
            )
        p = self._best(prefill, worth)
        pullable = {w: c.pullable for w, c in tiers.items()}
        plan = self._with_pull(RoutePlan(p, d, d_blocks, hashes), routable, cached, pullable)
        hit = self._hit(prompt, cached.get(p.name, 0) + len(plan.pull_hashes))
        return replace(plan, predicted_tokens=hit, available_tokens=available)

    def _hit(self, prompt: Sequence[int], blocks: int) -> int:
        """Tokens of ``blocks`` leading cached blocks the engine can reuse."""
        return max(0, min(blocks, (len(prompt) - 1) // self.block_size)) * self.block_size

    def _with_pull(
        self,
        plan: RoutePlan,
        workers: Sequence[WorkerHandle],
        cached: dict[str, int],
        pullable: dict[str, int],
    ) -> RoutePlan:
        """Pull the prefix from the worker holding most of it when the chosen
        prefill worker lacks at least pull_min_blocks of it: moving a block's KV
        costs far less than pushing its tokens through every layer again.
        ``cached``: each worker's leading blocks in either tier (the prefill
        worker restores its own from its tier); ``pullable``: those a source can
        lend, its leading device blocks (its pool pins only those)."""
        assert plan.prefill is not None
        have = cached.get(plan.prefill.name, 0)
        holders = [w for w in workers if w is not plan.prefill and w.info.kv_address]
        if not self.pull_min_blocks or not holders:
            return plan
        holder = max(holders, key=lambda w: pullable.get(w.name, 0))
        most = pullable.get(holder.name, 0)
        if most - have < self.pull_min_blocks:
            return plan
        return RoutePlan(
            plan.prefill, plan.decode, plan.decode_cached_blocks, plan.hashes,
            holder, plan.hashes[have:most],
        )  # fmt: skip

    def _lookup(self, hashes: Sequence[BlockHash]) -> dict[str, TierCounts]:
        """Each worker's leading cached blocks, by tier where the index knows it."""
        if isinstance(self.index, TieredIndex):
            return self.index.lookup_tiers(hashes)
        return {w: TierCounts(n) for w, n in self.index.lookup(hashes).items()}

    def _best(self, workers: Sequence[WorkerHandle], cached: dict[str, float]) -> WorkerHandle:
        if not cached:
            return self.fallback.pick(workers)
        scores = {w: cached.get(w.name, 0) - self.load_weight * w.in_flight for w in workers}
        top = max(scores.values())
        return self.fallback.pick([w for w in workers if scores[w] == top])
