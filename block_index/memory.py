"""The in-process block index (the default: one machine, no server)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence

from block_index.base import KVEvent, TierCounts

logger = logging.getLogger(__name__)


class InMemoryIndex:
    """Block hash -> workers holding it, and worker -> its hashes.

    ``lookup`` costs one dict probe per hash asked and stops at the first
    hash no remaining worker holds. All methods take one lock, so a
    background thread may apply events while the router looks up.

    The holder sets are interned frozensets: the many hashes held by the
    same workers share one object, which saves a set per hash (~200 bytes)
    and keeps lookups cache-friendly.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_hash: dict[bytes, frozenset[str]] = {}
        self._by_worker: dict[str, set[bytes]] = {}
        self._combos: dict[frozenset[str], frozenset[str]] = {}
        self._combos_gc_at = 1024
        self._host: dict[str, set[bytes]] = {}  # worker -> hashes only in its host tier

    def _intern(self, holders: frozenset[str]) -> frozenset[str]:
        combos = self._combos
        c = combos.get(holders)
        if c is None:
            if len(combos) >= self._combos_gc_at:  # forget combinations no hash uses
                combos = self._combos = {v: v for v in self._by_hash.values()}
                self._combos_gc_at = max(1024, 2 * len(combos))
            combos[holders] = c = holders
        return c

    # -- writing ---------------------------------------------------------

    def apply(self, event: KVEvent) -> None:
        """Apply ``reset``, then ``removed``, then ``stored``.

        The worker becomes known (``workers()``) even if it holds nothing.
        """
        with self._lock:
            worker = event.worker
            held = self._by_worker.get(worker)
            if held is None:
                held = self._by_worker[worker] = set()
            elif event.reset:
                self._forget(worker, held)
                held.clear()
            by_hash = self._by_hash
            if event.removed:
                self._forget(worker, [h for h in event.removed if h in held])
                held.difference_update(event.removed)
            if event.stored:
                alone = self._intern(frozenset((worker,)))
                added: dict[frozenset[str], frozenset[str]] = {}  # old holders -> new
                for h in event.stored:
                    if h in held:
                        continue
                    held.add(h)
                    old = by_hash.get(h)
                    if old is None:
                        by_hash[h] = alone
                    else:
                        new = added.get(old)
                        if new is None:
                            new = added[old] = self._intern(old | alone)
                        by_hash[h] = new
            self._apply_tiers(event)

    def _apply_tiers(self, event: KVEvent) -> None:
        """Which of the worker's hashes are only in its host tier."""
        host = self._host.get(event.worker)
        if host is None and not event.host:
            return
        if host is None:
            host = self._host[event.worker] = set()
        if event.reset:
            host.clear()
        host.difference_update(event.removed)
        host.difference_update(event.stored)
        host.update(event.host)

    def drop_worker(self, worker: str) -> None:
        with self._lock:
            self._host.pop(worker, None)
            held = self._by_worker.pop(worker, None)
            if held:
                self._forget(worker, held)

    def replace_all(self, snapshot: Mapping[str, Iterable[bytes]]) -> None:
        """Replace the whole content: ``snapshot`` is worker -> hashes it holds."""
        holders_of: dict[bytes, list[str]] = {}
        by_worker: dict[str, set[bytes]] = {}
        for worker, hashes in snapshot.items():
            held = by_worker[worker] = set(hashes)
            for h in held:
                lst = holders_of.get(h)
                if lst is None:
                    holders_of[h] = [worker]
                else:
                    lst.append(worker)
        combos: dict[frozenset[str], frozenset[str]] = {}
        by_hash: dict[bytes, frozenset[str]] = {}
        for h, lst in holders_of.items():
            fs = frozenset(lst)
            by_hash[h] = combos.setdefault(fs, fs)
        with self._lock:
            self._by_hash = by_hash
            self._by_worker = by_worker
            self._combos = combos
            self._combos_gc_at = max(1024, 2 * len(combos))
            self._host = {}  # a snapshot names no tier: all count as on the device

    def _forget(self, worker: str, held: Iterable[bytes]) -> None:
        by_hash = self._by_hash
        alone = frozenset((worker,))
        removed: dict[frozenset[str], frozenset[str] | None] = {}  # old holders -> new
        for h in held:
            old = by_hash.get(h)
            if old is None or worker not in old:
                continue
            if old in removed:
                new = removed[old]
            else:
                rest = old - alone
                new = removed[old] = self._intern(rest) if rest else None
            if new is None:
                del by_hash[h]
            else:
                by_hash[h] = new

    # -- reading ---------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Worker -> number of leading ``hashes`` it holds (workers with >= 1)."""
        try:
            with self._lock:
                return self._lookup(hashes)
        except Exception:  # never raise into the router
            logger.exception("block index lookup failed")
            return {}

    def lookup_tiers(self, hashes: Sequence[bytes]) -> dict[str, TierCounts]:
        """``lookup``, with how many of each worker's leading blocks are only
        in its host tier."""
        try:
            with self._lock:
                counts = self._lookup(hashes)
                return {w: self._tier_counts(w, hashes[:n]) for w, n in counts.items()}
        except Exception:  # never raise into the router
            logger.exception("block index lookup failed")
            return {}

    def _tier_counts(self, worker: str, hashes: Sequence[bytes]) -> TierCounts:
        host = self._host.get(worker)
        in_host = [h in host for h in hashes] if host else []
        if not any(in_host):
            return TierCounts(len(hashes))
        return TierCounts(len(hashes), sum(in_host), in_host.index(True))

    def host_blocks(self, worker: str) -> set[bytes]:
        """A copy of the hashes ``worker`` holds only in its host tier."""
        with self._lock:
            return set(self._host.get(worker, ()))

    def _lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        n = len(hashes)
        if n == 0:
            return {}
        by_hash = self._by_hash
        first = by_hash.get(hashes[0])
        if not first:
            return {}
        result: dict[str, int] = {}
        if len(first) == 1:  # the common case: one worker holds the prefix
            (worker,) = first
            i = 1
            while i < n:
                holders = by_hash.get(hashes[i])
                if holders is None or worker not in holders:
                    break
                i += 1
            result[worker] = i
            return result
        alive = set(first)
        for i in range(1, n):
            holders = by_hash.get(hashes[i])
            if holders is None:
                for w in alive:
                    result[w] = i
                return result
            if alive <= holders:
                continue
            lost = alive - holders
            for w in lost:
                result[w] = i
            alive -= lost
            if not alive:
                return result
        for w in alive:
            result[w] = n
        return result

    def workers(self) -> set[str]:
        with self._lock:
            return set(self._by_worker)

    def num_blocks(self, worker: str | None = None) -> int:
        """Blocks held by ``worker``, or (worker, block) entries in all."""
        with self._lock:
            if worker is not None:
                return len(self._by_worker.get(worker, ()))
            return sum(len(s) for s in self._by_worker.values())

    def blocks(self, worker: str) -> set[bytes]:
        """A copy of the hashes ``worker`` holds."""
        with self._lock:
            return set(self._by_worker.get(worker, ()))

    def retract(self, worker: str, hashes: Iterable[bytes]) -> None:
        """Forget that ``worker`` holds ``hashes`` (stale entries, block_index/reconcile.py)."""
        self.apply(KVEvent(worker, removed=tuple(hashes)))

    @property
    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


class InProcessPublisher:
    """An ``EventPublisher`` that applies events straight to a local index."""

    def __init__(self, index: InMemoryIndex) -> None:
        self._index = index

    def publish(self, event: KVEvent) -> None:
        try:
            self._index.apply(event)
        except Exception:
            logger.exception("applying a KV event failed")

    def close(self) -> None:
        pass
