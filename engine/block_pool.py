"""The block pool: the one owner of KV block references, and the prefix cache.

Every reference to a block belongs to a ``Holder``, a (kind, id) pair:

- ``request``: a sequence's block table (id: the request id),
- ``lease``: blocks reserved, pinned or received for one KV transfer,
  including the cached prefix a push's receiver already held and so was
  not sent (id: the transfer, see ``kv_transfer.lease.lease_holder``),
- ``draft``: a draft model's blocks for a request, in the draft's own pool,
- ``scratch``: blocks an engine sets aside for its lifetime.

The pool keeps, per holder, the blocks it holds in the order it got them
(a block twice if it got it twice); a block's reference count is how many
times holders hold it. References are only ever added (``allocate``,
``match_prefix``, ``acquire``), dropped (``release``) or handed from one
holder to another (``transfer``, with no moment where the block has no
reference) through the pool, by holder. A holder exists while it holds a
block, so ``holders()`` being empty means nothing is left over: the check
every test ends with.

A block is

- in use: held by at least one holder,
- cached: held by none, but full and hashed, so a later request with the
  same prefix can take it back; evicted in LRU order only when a fresh
  block is needed,
- free: held by none and not hashed.

``num_free`` counts free plus cached blocks: everything allocatable.

With a second tier attached (``attach_tier``, engine/kv_tier.py), a cached
block the pool evicts is first copied to the tier, and ``match_prefix``
goes on past the device pool's cached prefix: for each next hash the tier
holds (tokens checked), it takes a fresh block, the tier copies the data
in, and the block is cached under that hash and held like any matched
block. The tier holds data, never references: every reference is still
a holder's, here.

Blocks are released last first (a holder's tail before its head), so a
sequence's tail blocks are evicted before its head, which other requests
are likelier to share.

Misuse raises ``HolderError``: releasing or handing over a block the holder
does not hold, releasing everything of a holder that holds nothing (a
double release, or an unknown holder), acquiring a block that is neither in
use nor cached. An explicit empty list of blocks is always a no-op.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from engine.hashing import BlockHash

HolderKind = Literal["request", "lease", "draft", "scratch"]
HOLDER_KINDS: frozenset[str] = frozenset(get_args(HolderKind))


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds block references: a request, a transfer lease, a pin, ..."""

    kind: HolderKind
    id: str

    def __post_init__(self) -> None:
        if self.kind not in HOLDER_KINDS:
            raise ValueError(
                f"holder kind must be one of {sorted(HOLDER_KINDS)}, got {self.kind!r}"
            )

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


@dataclass(frozen=True)
class Held:
    """The references ``holder`` has on ``block_ids``, in order: what one part
    of the code hands another (a transfer's blocks to the request that goes
    on from them)."""

    holder: Holder
    block_ids: list[int]


class HolderError(RuntimeError):
    """A holder released or handed over a reference it does not have."""


class BlockTier(Protocol):
    """A second tier behind the pool (engine/kv_tier.py's ``KVTier``)."""

    def spill(self, block: int, block_hash: BlockHash, tokens: Sequence[int]) -> None: ...
    def has(self, block_hash: BlockHash, tokens: Sequence[int]) -> bool: ...
    def restore(self, block_hash: BlockHash, tokens: Sequence[int], block: int) -> bool: ...
    def holds(self, block_hash: BlockHash) -> bool: ...
    def hashes(self) -> list[BlockHash]: ...
    def discard(self, block_hash: BlockHash) -> None: ...
    def drain_changed(self) -> set[BlockHash]: ...


@dataclass(frozen=True)
class CacheDelta:
    """The net change of what a worker caches since the last drain, by where
    each hash is now: the device pool, only the second tier, or neither."""

    device: list[BlockHash]
    host: list[BlockHash]
    removed: list[BlockHash]


class BlockPool:
    """Block ids, their holders, and the prefix cache over them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._held: dict[Holder, list[int]] = {}
        # Free blocks without a hash: reused first, lowest id first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks with ref 0, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, BlockHash] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._block_of: dict[BlockHash, int] = {}
        # Hashes cached (True) or evicted (False) since the last drain; the
        # last change of each hash wins, so a drain is the net change.
        self._changes: dict[BlockHash, bool] = {}
        self.tier: BlockTier | None = None
        self.num_hits = 0  # prefix blocks found on the device (a tier counts its own)
        self.uncounted_hits = 0  # of the last match_prefix(count_hits=False)

    def attach_tier(self, tier: BlockTier) -> None:
        """Spill evicted cached blocks to ``tier`` and restore prefix hits from it."""
        self.tier = tier

    # ---- figures ------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_holders(self) -> int:
        return len(self._held)

    def holders(self) -> list[Holder]:
        """Every holder that holds a block, in the order they first got one."""
        return list(self._held)

    def held_by(self, holder: Holder) -> list[int]:
        """The blocks ``holder`` holds, in the order it got them ([] if none)."""
        return list(self._held.get(holder, ()))

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # ---- references -----------------------------------------------------------

    def allocate(self, holder: Holder, n: int) -> list[int] | None:
        """``n`` fresh blocks for ``holder``, or None (and no change) if too few."""
        if n > self.num_free:
            return None
        blocks = [self._fresh() for _ in range(n)]
        self._add(holder, blocks)
        return blocks

    def match_prefix(
        self,
        holder: Holder,
        hashes: Sequence[BlockHash],
        token_blocks: Sequence[Sequence[int]],
        *,
        count_hits: bool = True,
    ) -> list[int]:
        """Longest run of cached blocks for ``hashes``; ``holder`` acquires each.

        The tokens are compared too, so a hash collision is a miss, never
        wrong output. ``count_hits=False``: the blocks found on the device are
        left in ``uncounted_hits`` for ``count_hits()`` once the caller keeps
        the match (the scheduler retries an admission every step while a
        request waits: a retry must not count its prefix again).
        """
        matched: list[int] = []
        device_hits = 0
        for block_hash, tokens in zip(hashes, token_blocks, strict=False):
            block = self._block_of.get(block_hash)
            if block is None:
                block = self._restore(block_hash, tokens)
                if block is None:
                    break
            elif self._tokens_of[block] != tuple(tokens):
                break
            else:  # referenced at once: a restore's fresh block must not evict it
                self._ref([block])
                device_hits += 1
            matched.append(block)
        self._add(holder, matched)
        if count_hits:
            self.num_hits += device_hits
        else:
            self.uncounted_hits = device_hits
        return matched

    def count_hits(self) -> None:
        """Count the device hits of the last ``match_prefix(count_hits=False)``."""
        self.num_hits += self.uncounted_hits
        self.uncounted_hits = 0

    def acquire(self, holder: Holder, blocks: Sequence[int]) -> None:
        """``holder`` takes a reference to blocks that are in use or cached."""
        for block in blocks:
            if self._refs[block] == 0 and block not in self._evictable:
                raise HolderError(f"block {block} is neither in use nor cached")
        self._ref(blocks)
        self._add(holder, blocks)

    def release(self, holder: Holder, blocks: Sequence[int] | None = None) -> list[int]:
        """Drop ``holder``'s references to ``blocks`` (None: to everything it
        holds, which must be something); the blocks released, in order."""
        released = self._take_from(holder, blocks)
        for block in reversed(released):
            self._unref(block)
        return released

    def release_held(self, parts: Iterable[Held]) -> None:
        for part in parts:
            self.release(part.holder, part.block_ids)

    def transfer(self, src: Holder, dst: Holder, blocks: Sequence[int] | None = None) -> list[int]:
        """Hand ``src``'s references to ``blocks`` (None: everything it holds)
        to ``dst``; reference counts do not change. The blocks, in order."""
        if src == dst:
            raise HolderError(f"{src} cannot hand blocks to itself")
        moved = self._take_from(src, blocks)
        self._add(dst, moved)
        return moved

    def verify(self) -> None:
        """Check that reference counts are what the holders hold and that every
        block is in exactly one state; HolderError if not (for tests)."""
        counts = [0] * self.num_blocks
        for blocks in self._held.values():
            for block in blocks:
                counts[block] += 1
        if counts != self._refs:
            raise HolderError("reference counts differ from what the holders hold")
        idle = sorted([*self._free, *self._evictable])
        if idle != [b for b, count in enumerate(counts) if count == 0]:
            raise HolderError("the free and cached lists differ from the unheld blocks")

    # ---- the prefix cache -------------------------------------------------------

    def cache(self, block: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, in-use block under its hash. False if the hash is
        already held by another block (the caller keeps its own copy)."""
        if block in self._hash_of:
            return self._hash_of[block] == block_hash
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._tokens_of[block] = tuple(token_ids)
        self._block_of[block_hash] = block
        self._changes[block_hash] = True
        return True

    def forget(self, blocks: Sequence[int]) -> None:
        """Take ``blocks`` out of the prefix cache (their KV is suspect: a
        request that read them got non-finite logits). Holders keep them;
        each is free once its last holder lets go."""
        for block in blocks:
            if block not in self._hash_of:
                continue
            if self.tier is not None:
                self.tier.discard(self._hash_of[block])
            self._uncache(block)
            if self._refs[block] == 0:
                del self._evictable[block]
                self._free.append(block)

    def block_for_hash(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of.get(block)

    def tokens_of(self, block: int) -> tuple[int, ...] | None:
        """Token ids of a cached block, None if the block has no hash."""
        return self._tokens_of.get(block)

    def drain_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, removed): the net change of what this pool and its tier
        cache since the last drain, for the block index (a hash in either
        tier counts as stored)."""
        delta = self.drain_delta()
        return delta.device + delta.host, delta.removed

    def drain_delta(self) -> CacheDelta:
        """The net change since the last drain, by tier."""
        changes, self._changes = self._changes, {}
        changed = list(changes)
        if self.tier is not None:
            changed += [h for h in self.tier.drain_changed() if h not in changes]
        delta = CacheDelta([], [], [])
        for h in changed:
            self._where(h, delta).append(h)
        return delta

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the cache holds now, in either tier (a snapshot for the
        block index)."""
        return [*self._block_of, *self.host_hashes()]

    def host_hashes(self) -> list[BlockHash]:
        """Hashes only the second tier holds now."""
        if self.tier is None:
            return []
        return [h for h in self.tier.hashes() if h not in self._block_of]

    # ---- internals --------------------------------------------------------------

    def _fresh(self) -> int:
        """A block with no holder, with ref 1: a free one, else the LRU cached one."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            if self.tier is not None:  # its data is intact until the new holder writes
                self.tier.spill(block, self._hash_of[block], self._tokens_of[block])
            self._uncache(block)
        self._refs[block] = 1
        return block

    def _restore(self, block_hash: BlockHash, tokens: Sequence[int]) -> int | None:
        """A fresh block (ref 1) holding the tier's copy of ``block_hash``,
        cached under it; None when the tier lacks it or no block is free."""
        tier = self.tier
        if tier is None or not self.num_free or not tier.has(block_hash, tokens):
            return None
        block = self._fresh()  # may spill another block: the tier keeps this entry's slot
        if not tier.restore(block_hash, tokens, block):
            self._unref(block)  # uncached, ref 1: back to the free list
            return None
        self._hash_of[block] = block_hash
        self._tokens_of[block] = tuple(tokens)
        self._block_of[block_hash] = block
        self._changes[block_hash] = True
        return block

    def _where(self, block_hash: BlockHash, delta: CacheDelta) -> list[BlockHash]:
        if block_hash in self._block_of:
            return delta.device
        if self.tier is not None and self.tier.holds(block_hash):
            return delta.host
        return delta.removed

    def _add(self, holder: Holder, blocks: Sequence[int]) -> None:
        if blocks:
            self._held.setdefault(holder, []).extend(blocks)

    def _take_from(self, holder: Holder, blocks: Sequence[int] | None) -> list[int]:
        """Remove ``blocks`` (None: all) from what ``holder`` holds, all or
        nothing; the blocks removed, in order. References do not change."""
        held = self._held.get(holder)
        if blocks is None:
            if not held:
                raise HolderError(f"{holder} holds no blocks (released twice?)")
            del self._held[holder]
            return held
        if not blocks:
            return []
        remaining = list(held or ())
        for block in reversed(blocks):  # a tail is found at the end: one step each
            i = _last_index(remaining, block)
            if i < 0:
                raise HolderError(f"{holder} does not hold block {block}")
            del remaining[i]
        if remaining:
            self._held[holder] = remaining
        else:
            del self._held[holder]
        return list(blocks)

    def _ref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _uncache(self, block: int) -> None:
        block_hash = self._hash_of.pop(block)
        del self._tokens_of[block]
        del self._block_of[block_hash]
        self._changes[block_hash] = False


def _last_index(items: list[int], value: int) -> int:
    for i in range(len(items) - 1, -1, -1):
        if items[i] == value:
            return i
    return -1
