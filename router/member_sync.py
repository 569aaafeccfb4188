"""A router's copy of its deployment's membership, kept in step with the
deployment's owner (router/deployment.py).

The owner's generation changes with every change any router makes (a scale,
a replacement): each router polls it (``MEMBERSHIP_POLL_S``, one cheap call)
and, when it moved, takes the members: new workers are asked their info (a
running worker is not started again), subscribed to and put in routing;
workers gone leave routing, the index and the streams. A new worker that
does not answer yet is tried again on the next poll.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.pool_controller import Members, WorkerRef
from router.pool_manager import WorkerHandle

if TYPE_CHECKING:
    from router.ray_backend import RayBackend

log = logging.getLogger(__name__)

MEMBERSHIP_POLL_S = 1.0
INFO_TIMEOUT_S = 30.0


class MemberSync:
    def __init__(self, backend: RayBackend) -> None:
        self.backend = backend
        self.known: dict[str, WorkerHandle] = {}  # every member this router took, by name
        self.generation: str | None = None
        self._lock = asyncio.Lock()

    def count(self, role: str) -> int:
        """Members of ``role`` (in routing or not)."""
        return sum(1 for w in self.known.values() if w.role == role)

    async def connect(self, members: Members) -> list[WorkerHandle]:
        """The first members, with their info, before the backend has its index:
        ``join_all`` then puts them in routing."""
        handles = await asyncio.gather(*(_handle(r) for r in members.workers))
        if not handles:
            raise RuntimeError("the deployment has no worker")
        self.known = {h.name: h for h in handles}
        self.generation = members.generation
        return list(handles)

    async def join_all(self) -> None:
        for worker in self.known.values():
            await self._enter(worker)

    async def sync(self, members: Members) -> None:
        """Take ``members`` (a newer generation) as the membership."""
        async with self._lock:
            if members.generation == self.generation:
                return
            current = {r.name for r in members.workers}
            for name in [n for n in self.known if n not in current]:
                await self._leave(self.known.pop(name))
            new = [r for r in members.workers if r.name not in self.known]
            made = await asyncio.gather(*(_handle(r) for r in new), return_exceptions=True)
            complete = True
            for ref, worker in zip(new, made, strict=True):
                try:
                    if isinstance(worker, BaseException):
                        raise worker
                    await self._enter(worker)
                except Exception as exc:
                    log.warning("new worker %s not taken yet: %r", ref.name, exc)
                    complete = False
                    continue
                self.known[ref.name] = worker
            if complete:  # else the next poll tries the missing ones again
                self.generation = members.generation

    async def poll(self, interval_s: float) -> None:
        deployment = self.backend.deployment
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await deployment.call("generation") != self.generation:
                    await self.sync(await deployment.call("members"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # its owner restarting: ask again
                log.warning("membership poll failed: %r", exc)

    async def _enter(self, worker: WorkerHandle) -> None:
        await self.backend.streams.subscribe(worker)
        self.backend.pool_of(worker.role).workers.append(worker)

    async def _leave(self, worker: WorkerHandle) -> None:
        log.warning("worker %s left the deployment", worker.name)
        self.backend.pool_of(worker.role).remove([worker])
        self.backend.recovery.forget(worker)
        await self.backend._worker_down(worker)


async def _handle(ref: WorkerRef) -> WorkerHandle:
    info = await asyncio.wait_for(ref.actor.info.remote(), INFO_TIMEOUT_S)
    return WorkerHandle(ref.name, ref.role, ref.actor, info)
