"""What a router does when its workers change: a scale through the
deployment, dead workers dropped and replaced, a worker leaving routing or
coming back (router/worker_recovery.py calls these), and the lost workers
it still owes the deployment's owner a report of.

The deployment's owner (router/pool_controller.py) makes every change; the
router drains the workers it removes, forgets what it knew of a worker that
left (its blocks in the index, its room, its output stream), and takes the
members the owner returns (router/member_sync.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.backend import PlacementTimeout
from router.pool_manager import WorkerHandle, WorkerPool

if TYPE_CHECKING:
    from router.ray_backend import RayBackend

log = logging.getLogger(__name__)


class WorkerChanges:
    def __init__(self, backend: RayBackend) -> None:
        self.backend = backend
        self.lost: set[str] = set()  # workers recovery gave up, not reported yet
        self._scale_lock = asyncio.Lock()

    # ---- changes the router asks for ------------------------------------

    async def scale(
        self, prefill: int | None, decode: int | None, drain_timeout_s: float
    ) -> tuple[int, int]:
        """Resize the pools through the deployment; workers removed drain this
        router's requests before they stop. Returns (prefill, decode) afterwards."""
        b = self.backend
        b.config.pools.resized(prefill, decode)  # a ValueError for sizes the config refuses
        assert b.deployment is not None, "backend not started"
        async with self._scale_lock:
            for pool, n in ((b.prefill, prefill), (b.decode, decode)):
                if n is None or (b.colocated and pool is b.prefill):
                    continue
                count = b.members.count(pool.role)
                if n > count:
                    members = await self._grow(pool, n)
                elif n < count:
                    gone = pool.take_out(min(count - n, len(pool.workers)))
                    await WorkerPool.drain(gone, drain_timeout_s)
                    for worker in gone:
                        await self.worker_down(worker)
                    names = [w.name for w in gone]
                    members = await b.deployment.call("shrink", pool.role, names)
                else:
                    continue
                await b.members.sync(members)
            return len(b.prefill.workers), len(b.decode.workers)

    async def grow_to(self, role: str, n: int) -> int:
        """Grow ``role``'s pool to ``n`` members through the deployment, never
        shrinking it (the autoscaler's growth: a retirement, not this, takes
        workers away). Returns its members afterwards."""
        b = self.backend
        assert b.deployment is not None, "backend not started"
        async with self._scale_lock:
            pool = b.pool_of(role)
            if n > b.members.count(role):
                await b.members.sync(await self._grow(pool, n))
            return b.members.count(role)

    async def _grow(self, pool: WorkerPool, n: int):
        """The deployment grows ``pool`` to ``n`` within ``pools.placement_timeout_s``;
        past it the new workers are gone and PlacementTimeout says so."""
        b = self.backend
        timeout_s = b.config.pools.placement_timeout_s
        try:
            return await b.deployment.call("grow", pool.role, n, timeout_s)
        except Exception as exc:
            if not isinstance(exc, TimeoutError | asyncio.TimeoutError) and not isinstance(
                getattr(exc, "cause", None), TimeoutError
            ):
                raise
            added = n - b.members.count(pool.role)
            raise PlacementTimeout(
                f"{added} new {pool.role} workers were not placed and started within "
                f"pools.placement_timeout_s ({timeout_s:g} s): no node has room for their "
                f"resources, or they start slowly; they were removed, and the pools are "
                f"prefill {len(b.prefill.workers)}, decode {len(b.decode.workers)}"
            ) from None

    async def replace_dead_workers(
        self, ping_timeout_s: float, placement_timeout_s: float | None
    ) -> list[str]:
        """See ``RayBackend.replace_dead_workers``."""
        b = self.backend
        if placement_timeout_s is None:
            placement_timeout_s = b.config.pools.placement_timeout_s
        dropped = await self._drop_dead(ping_timeout_s)
        self.lost |= set(dropped)
        lost = sorted(self.lost)
        if lost:
            members = await b.deployment.call("lost", lost)
            self.lost -= set(lost)  # only once the owner has them
            await b.members.sync(members)
        await b.members.sync(await b.deployment.call("replace_owed", placement_timeout_s))
        return dropped

    async def _drop_dead(self, ping_timeout_s: float) -> list[str]:
        """Take the workers that died for good out of routing. Returns their names."""
        dropped: list[str] = []
        for pool in (self.backend.prefill, self.backend.decode):
            found = await pool.find_dead(ping_timeout_s)
            dead = [w for w in found if w in pool.workers]  # not taken out by a scale meanwhile
            if not dead:
                continue
            log.warning("%s workers died: %s", pool.role, [w.name for w in dead])
            pool.remove(dead)
            dropped += [w.name for w in dead]
            for worker in dead:
                await self.worker_down(worker)
        return dropped

    async def watch(self, interval_s: float) -> None:
        """Replace dead workers every ``interval_s`` (pools.worker_check_interval_s)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.backend.replace_dead_workers()
            except Exception:
                log.exception("replacing dead workers failed; trying again in %.1f s", interval_s)

    # ---- what recovery and the membership tell ---------------------------

    async def worker_down(self, worker: WorkerHandle) -> None:
        """A worker left routing: forget its blocks, its room and its output
        stream; wake the waiting requests (they may fit elsewhere, or find no
        worker in routing and fail over or end now, not at their deadline)."""
        b = self.backend
        b.admission.rooms.forget(worker.name)
        b.admission.wake()
        if b.index is not None:
            b.index.drop_worker(worker.name)
        await b.streams.unsubscribe(worker)

    def worker_lost(self, worker: WorkerHandle, pool: WorkerPool) -> None:
        """Recovery gave a worker up (and killed it, if ephemeral): the next check
        (pools.worker_check_interval_s) reports it to the deployment, which
        starts a replacement where the pool's resources remain."""
        self.lost.add(worker.name)

    async def worker_back(self, worker: WorkerHandle) -> None:
        """A worker passed its health check: listen to it again."""
        b = self.backend
        if b.index is not None:
            b.index.drop_worker(worker.name)  # a restarted worker starts empty
        await b.streams.subscribe(worker)
