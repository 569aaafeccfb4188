"""Taking dead workers out of routing and back in once they are healthy.

When a try finds a worker dead (a Ray actor error, or its output stream
broke), ``suspect`` takes it out of its pool at once, so no new request is
routed to it, and the backend forgets it (the block index drops every entry
of it, the router drops its output stream). A watcher then asks the actor
for its health until it answers:

- the same incarnation, started: it was alive after all (say, a transfer
  failed); it goes back as it was;
- a new incarnation, not started: Ray restarted the actor (``max_restarts``),
  with a fresh engine and an empty KV pool; it is started, must pass the
  health check, and goes back with its new addresses;
- no answer before ``recovery_timeout_s``, or Ray reports the actor dead for
  good (no restarts left, or its node is gone with ``max_restarts`` 0): it is
  forgotten, and ``on_lost`` tells the backend, which reports it to the
  deployment's owner; the owner starts a replacement where the pool's
  resources remain. With ``kill_lost`` (an ephemeral deployment: this router
  owns its workers) the worker is killed first; a named deployment's workers
  are shared, so the owner judges them with its own health check instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import ray

from router import health
from router.failover import FailoverStats
from router.health import Health
from router.pool_manager import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a restarted actor loads the model again


class WorkerRecovery:
    def __init__(
        self,
        pools: list[WorkerPool],
        on_down: Callable[[WorkerHandle], Awaitable[None]],
        on_back: Callable[[WorkerHandle], Awaitable[None]],
        stats: FailoverStats,
        *,
        on_lost: Callable[[WorkerHandle, WorkerPool], None] | None = None,
        enter: Callable[[WorkerHandle], bool] | None = None,
        recovery_timeout_s: float = 120.0,
        health_timeout_s: float = 10.0,
        poll_s: float = 0.5,
        kill_lost: bool = True,
    ) -> None:
        self.pools = pools
        self.on_down = on_down
        self.on_back = on_back
        self.stats = stats
        self.enter = enter  # puts a worker back in routing, or refuses (router/member_sync.py)
        self.on_lost = on_lost
        self.recovery_timeout_s = recovery_timeout_s
        self.health_timeout_s = health_timeout_s
        self.poll_s = poll_s
        self.kill_lost = kill_lost
        self.down: dict[WorkerHandle, asyncio.Task] = {}

    def is_down(self, worker: WorkerHandle) -> bool:
        return worker in self.down

    def suspect(self, worker: WorkerHandle, why: str) -> None:
        """Take ``worker`` out of routing and watch it until it is healthy again."""
        pool = next((p for p in self.pools if worker in p.workers), None)
        if worker in self.down or pool is None:  # already watched, or scaled away
            return
        log.warning("worker %s is out of routing: %s", worker.name, why)
        pool.workers.remove(worker)
        self.stats.workers_lost += 1
        self.down[worker] = asyncio.create_task(self._recover(worker, pool))

    def forget(self, worker: WorkerHandle) -> None:
        """Stop watching ``worker``: it left the deployment (another router
        reported it lost, or a scale removed it)."""
        task = self.down.pop(worker, None)
        if task is not None:
            task.cancel()

    async def wait_all(self, timeout_s: float) -> None:
        """Wait until every watched worker is back or given up (tests)."""
        if self.down:
            await asyncio.wait(list(self.down.values()), timeout=timeout_s)

    async def close(self) -> None:
        for task in self.down.values():
            task.cancel()
        await asyncio.gather(*self.down.values(), return_exceptions=True)
        self.down.clear()

    async def _recover(self, worker: WorkerHandle, pool: WorkerPool) -> None:
        try:
            await self.on_down(worker)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.recovery_timeout_s
            while loop.time() < deadline:
                try:
                    healthy = await self._healthy(worker)
                except ray.exceptions.ActorDiedError:
                    log.error("worker %s died for good; forgetting it", worker.name)
                    break
                if healthy and await self._back(worker):
                    self.down.pop(worker, None)  # no longer down: ``enter`` may take it
                    self.stats.workers_recovered += 1
                    if self._enter(worker, pool):
                        log.warning("worker %s is back in routing", worker.name)
                    else:
                        log.warning("worker %s is back, not in routing (retiring)", worker.name)
                    return
                await asyncio.sleep(self.poll_s)
            else:
                log.error("worker %s did not come back; forgetting it", worker.name)
            if self.kill_lost:
                ray.kill(worker.actor)
            if self.on_lost is not None:
                self.on_lost(worker, pool)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("recovering worker %s failed", worker.name)
        finally:
            self.down.pop(worker, None)

    def _enter(self, worker: WorkerHandle, pool: WorkerPool) -> bool:
        if self.enter is not None:
            return self.enter(worker)
        if worker in pool.workers:
            return False
        pool.workers.append(worker)
        return True

    async def _back(self, worker: WorkerHandle) -> bool:
        try:
            await self.on_back(worker)  # e.g. open its output stream again
        except Exception as exc:
            log.info("taking %s back failed: %s", worker.name, exc)
            return False
        return True

    async def _healthy(self, worker: WorkerHandle) -> bool:
        """One health check; starts a restarted actor first. ActorDiedError
        when no restart will come."""
        state = await health.check(worker, self.health_timeout_s)
        if state is Health.RESTARTED:  # a new incarnation: start it, then ask again
            try:
                worker.info = await asyncio.wait_for(worker.actor.start.remote(), START_TIMEOUT_S)
            except Exception as exc:  # still restarting, or failing to start: ask again later
                log.info("starting %s again: %s", worker.name, type(exc).__name__)
                return False
            state = await health.check(worker, self.health_timeout_s)
        if state is Health.DEAD:
            raise ray.exceptions.ActorDiedError()
        if state is Health.SILENT:
            log.info("health check of %s: no answer", worker.name)
        return state is Health.HEALTHY
