"""Noticing a worker that hangs instead of dying.

A dead worker shows at once (a Ray actor error, a broken output stream). A
hung one (a stopped process, a stuck engine thread) just goes silent. While
a request waits on a worker, every ``stall_check_s`` of silence the watchdog
asks the worker's engine thread for its health; a worker that does not
answer within ``health_timeout_s`` is taken out of routing like a dead one,
and the request fails over. A worker that is merely busy answers, and the
request keeps waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
import ray.exceptions

from router import health
from router.failover import WorkerLost
from router.health import Health
from router.pool_manager import WorkerHandle
from router.worker_recovery import WorkerRecovery
from router.worker_streams import LOST, DeltaQueue, Item


class Watchdog:
    def __init__(
        self,
        recovery: WorkerRecovery,
        *,
        stall_check_s: float = 5.0,
        health_timeout_s: float = 10.0,
    ) -> None:
        self.recovery = recovery
        self.stall_check_s = stall_check_s
        self.health_timeout_s = health_timeout_s

    async def call(self, worker: WorkerHandle, ref: Any) -> Any:
        """The result of an actor call. A dead or hung actor takes its worker
        out of routing and raises WorkerLost."""
        future = asyncio.ensure_future(ref)
        try:
            while True:
                done, _ = await asyncio.wait([future], timeout=self.stall_check_s)
                if done:
                    return future.result()
                if not await self.responds(worker):
                    with contextlib.suppress(Exception):
                        ray.cancel(ref)
                    raise self._lost(worker, "it stopped answering")
        except ray.exceptions.RayActorError as exc:
            raise self._lost(worker, type(exc).__name__) from exc
        finally:
            future.cancel()

    async def next_delta(self, queue: DeltaQueue, worker: WorkerHandle) -> Item:
        """The next delta of a request on ``worker``, or LOST (or CUT)."""
        if not queue.empty():  # under load the next step is often already here
            return queue.get_nowait()
        while True:
            try:  # asyncio.timeout, not wait_for: no task per token
                async with asyncio.timeout(self.stall_check_s):
                    return await queue.get()
            except TimeoutError:
                if not await self.responds(worker):
                    self.recovery.suspect(worker, "its stream went silent and it stopped answering")
                    return LOST

    async def responds(self, worker: WorkerHandle) -> bool:
        """True when the worker's engine answers a health check in time."""
        if self.recovery.is_down(worker):
            return False
        return await health.check(worker, self.health_timeout_s) is Health.HEALTHY

    def _lost(self, worker: WorkerHandle, why: str) -> WorkerLost:
        self.recovery.suspect(worker, why)
        return WorkerLost(worker.name, why)
