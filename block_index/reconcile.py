"""Reconcile the block index with the blocks workers actually hold.

The index is fed by events; one lost or misapplied event leaves an entry
naming a worker that does not hold the block (stale): the router then
predicts a prefix hit the worker cannot give. :func:`reconcile` asks each
worker for the hashes it holds and retracts, for that worker, every entry
it does not hold.

Order matters: the index's entries of a worker are read BEFORE the worker
lists its blocks, so a block cached in between is never judged stale (it is
not in the snapshot). A block evicted in between is rightly retracted (its
removal event is on its way; removing twice is harmless). The one race
left: a block evicted and cached again between the listing and the
retraction, whose stored event the index applied first, is retracted
though held. That entry then stays lost for as long as the block stays
resident (the worker sends no new event for a block it already caches):
the router does not count that block for that worker, so it may route the
prefix elsewhere or predict less than the worker gives, until the block is
evicted and cached again or the worker resets its index. The next pass
sees it among ``missing_entries`` but does not re-add it. Never a wrong
answer: the worker's own cache decides what is reused.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


class ReconcilableIndex(Protocol):
    """What reconcile needs of an index (InMemoryIndex and RedisIndex have it)."""

    def blocks(self, worker: str) -> set[bytes]: ...

    def retract(self, worker: str, hashes: Collection[bytes]) -> None: ...


@dataclass(frozen=True)
class ReconcileReport:
    """One reconcile pass."""

    checked_workers: int  # workers that listed their blocks
    checked_entries: int  # index entries of those workers, before the pass
    stale_entries: int  # of those, naming a block the worker did not hold: removed
    missing_entries: int  # blocks a worker holds that the index lacks (events in flight)
    unreachable: tuple[str, ...] = ()  # workers that did not answer (not checked)
    stale_by_worker: dict[str, int] = field(default_factory=dict)


async def reconcile(
    index: ReconcilableIndex,
    workers: Sequence[str],
    list_blocks: Callable[[str], Awaitable[Collection[bytes]]],
) -> ReconcileReport:
    """Retract the stale entries of ``workers``; ``list_blocks(worker)`` gives
    the hashes the worker holds now (it may raise: that worker is skipped)."""
    snapshots = {w: index.blocks(w) for w in workers}
    listings = await asyncio.gather(*(list_blocks(w) for w in workers), return_exceptions=True)
    checked = entries = missing = 0
    stale_by_worker: dict[str, int] = {}
    unreachable = []
    for w, held in zip(workers, listings, strict=True):
        if isinstance(held, BaseException):
            log.warning("reconcile: %s did not list its blocks: %s", w, held)
            unreachable.append(w)
            continue
        held = held if isinstance(held, set | frozenset) else set(held)
        snap = snapshots[w]
        stale = snap - held
        if stale:
            index.retract(w, stale)
            stale_by_worker[w] = len(stale)
        checked += 1
        entries += len(snap)
        missing += len(held - snap)
    return ReconcileReport(
        checked_workers=checked,
        checked_entries=entries,
        stale_entries=sum(stale_by_worker.values()),
        missing_entries=missing,
        unreachable=tuple(unreachable),
        stale_by_worker=stale_by_worker,
    )
