"""The router's side of reconciling its block index (block_index/reconcile.py):
ask each worker in routing for its blocks (``cached_blocks``), retract the
stale entries, count what was found (router/index_fidelity.py), every
``routing.index_reconcile_interval_s`` and on demand (Admin.ReconcileIndex)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from block_index import ReconcileReport, reconcile
from block_index.reconcile import ReconcilableIndex
from worker.logfmt import log_event

from .index_fidelity import ReconcileStats
from .pool_manager import WorkerHandle

log = logging.getLogger(__name__)

LIST_TIMEOUT_S = 30.0
"""How long a worker may take to list its blocks before it is left unchecked."""


class IndexReconciler:
    def __init__(
        self,
        index: Callable[[], ReconcilableIndex | None],
        workers: Callable[[], Sequence[WorkerHandle]],
    ) -> None:
        """``index``, ``workers``: the router's block index (None before it
        started) and the workers in routing, read at each pass."""
        self._index = index
        self._workers = workers
        self.stats = ReconcileStats()
        self._lock = asyncio.Lock()  # one pass at a time

    async def run(self) -> ReconcileReport:
        """One pass; raises RuntimeError before the index exists, and what the
        index raises (Redis unreachable)."""
        index = self._index()
        if index is None:
            raise RuntimeError("the block index is not built yet")
        by_name = {w.name: w for w in self._workers()}

        async def list_blocks(name: str) -> set[bytes]:
            call = by_name[name].actor.cached_blocks.remote()
            reply = await asyncio.wait_for(call, LIST_TIMEOUT_S)
            return set(reply.hashes)

        async with self._lock:
            try:
                report = await reconcile(index, sorted(by_name), list_blocks)
            except Exception as e:
                self.stats.failed(f"{type(e).__name__}: {e}")
                raise
        self.stats.record(report, by_name)
        log_event(
            log,
            "index_reconciled",
            workers=report.checked_workers,
            entries=report.checked_entries,
            stale=report.stale_entries,
            missing=report.missing_entries,
            unreachable=",".join(report.unreachable) or None,
        )
        return report

    async def every(self, interval_s: float) -> None:
        """Run a pass every ``interval_s`` until cancelled; a failed pass is logged."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.run()
            except Exception as e:
                log.warning("reconciling the block index failed: %s", e)
