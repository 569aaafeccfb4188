"""A router's copy of its deployment's membership, kept in step with the
deployment's owner (router/deployment.py).

The owner's generation changes with every change any router makes (a scale,
a replacement): each router polls it (``MEMBERSHIP_POLL_S``, one cheap call)
and, when it moved, takes the members: new workers are asked their info (a
running worker is not started again), subscribed to and put in routing;
workers gone leave routing, the index and the streams. A new worker that
does not answer yet, or has not finished starting, is tried again on the
next poll; one Ray reports dead for good is reported to the owner, which
judges it and owes a replacement.

A router starts on the members that answer and are started: it fails only
when a role it needs has none (after reporting the dead ones, whose
replacements the owner starts first).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import ray

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
        self.retiring: set[str] = set()  # known members taken out of routing as leaving
        self._lock = asyncio.Lock()

    def count(self, role: str) -> int:
        """Members of ``role`` (in routing or not)."""
        return sum(1 for w in self.known.values() if w.role == role)

    async def connect(self, members: Members) -> list[WorkerHandle]:
        """The first members that answer and are started, with their info, before
        the backend has its index (``join_all`` then puts them in routing). Dead
        ones are reported to the owner, and its replacements taken; the others
        are left to the poll. RuntimeError when a role the router needs has no
        usable worker."""
        handles, dead = await _usable(members.workers)
        if dead:
            members = await self._report_lost(dead)
            more, _ = await _usable([r for r in members.workers if r.name not in handles])
            handles.update(more)
        roles = {h.role for h in handles.values()}
        missing = [r for r in self._needed_roles() if r not in roles]
        if missing:
            name = self.backend.config.deployment.name
            raise RuntimeError(
                f"deployment {name!r} has no usable {' or '.join(missing)} worker (of "
                f"{len(members.workers)} members, {len(handles)} answer and are started): "
                f"wait for its replacements, or `tandem down --deployment {name}` and start again"
            )
        self.known = handles
        complete = len(handles) == len(members.workers)
        self.generation = members.generation if complete else None  # else the poll syncs
        return list(handles.values())

    def _needed_roles(self) -> list[str]:
        backend = self.backend
        return [backend.decode.role] + ([] if backend.colocated else ["prefill"])

    async def _report_lost(self, dead: list[str]) -> Members:
        """Report ``dead`` to the owner (it checks them itself), and start the
        replacements it owes. The members afterwards."""
        deployment = self.backend.deployment
        log.warning("workers dead for good: %s; reporting them to the deployment", dead)
        await deployment.call("lost", dead)
        timeout_s = self.backend.config.pools.placement_timeout_s
        return await deployment.call("replace_owed", timeout_s)

    async def join_all(self) -> None:
        for worker in self.known.values():
            await self.backend.streams.subscribe(worker)
            self.enter(worker)

    def enter(self, worker: WorkerHandle) -> bool:
        """Put ``worker`` in routing: the one way in (new members, a retirement
        called off, a recovered worker, router/worker_recovery.py). Refused
        (False) for a worker recovery watches as down, one retiring, one not
        a member (any more), or one in routing already."""
        pool = self.backend.pool_of(worker.role)
        if (
            self.backend.recovery.is_down(worker)
            or worker.name in self.retiring
            or self.known.get(worker.name) is not worker
            or any(w.name == worker.name for w in pool.workers)
        ):
            return False
        pool.workers.append(worker)
        return True

    async def sync(self, members: Members) -> None:
        """Take ``members`` (a newer generation) as the membership."""
        async with self._lock:
            if members.generation == self.generation:
                return
            if members.draining:  # going down: the requests in flight finish, no new ones
                log.warning("the deployment is going down: its workers leave routing")
                for pool in (self.backend.prefill, self.backend.decode):
                    pool.workers = []
                self.generation = members.generation
                return
            current = {r.name for r in members.workers}
            for name in [n for n in self.known if n not in current]:
                self.retiring.discard(name)
                await self._leave(self.known.pop(name))
            self._retiring(members.leaving)
            new = [
                r
                for r in members.workers
                if r.name not in self.known and r.name not in members.leaving
            ]
            made = await asyncio.gather(*(_handle(r) for r in new), return_exceptions=True)
            complete = True
            for ref, worker in zip(new, made, strict=True):
                try:
                    if isinstance(worker, ray.exceptions.ActorDiedError):
                        self.backend.changes.lost.add(ref.name)  # the next check reports it
                    if isinstance(worker, BaseException):
                        raise worker
                    await self.backend.streams.subscribe(worker)
                except Exception as exc:
                    log.warning("new worker %s not taken yet: %r", ref.name, exc)
                    complete = False
                    continue
                self.known[ref.name] = worker
                self.enter(worker)
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

    def _retiring(self, leaving: frozenset[str]) -> None:
        """Workers the owner retires leave routing (their requests go on: they
        keep their streams until they leave the membership): the one way out
        for a retirement. One no longer retiring (its retirement was called
        off) comes back through ``enter`` (not while recovery has it down)."""
        for name in (leaving & set(self.known)) - self.retiring:
            worker = self.known[name]
            self.backend.pool_of(worker.role).remove([worker])
            self.retiring.add(name)
        for name in self.retiring - leaving:
            self.retiring.discard(name)
            self.enter(self.known[name])

    async def _leave(self, worker: WorkerHandle) -> None:
        log.warning("worker %s left the deployment", worker.name)
        self.backend.pool_of(worker.role).remove([worker])
        self.backend.recovery.forget(worker)
        await self.backend.changes.worker_down(worker)


class NotStarted(RuntimeError):
    """A member whose actor has not finished starting."""


async def _handle(ref: WorkerRef) -> WorkerHandle:
    info = await asyncio.wait_for(ref.actor.info.remote(), INFO_TIMEOUT_S)
    if not info.started:
        raise NotStarted(f"worker {ref.name} has not finished starting")
    return WorkerHandle(ref.name, ref.role, ref.actor, info)


async def _usable(refs) -> tuple[dict[str, WorkerHandle], list[str]]:
    """The members of ``refs`` that answer and are started, by name, and the
    names of those Ray reports dead for good."""
    made = await asyncio.gather(*(_handle(r) for r in refs), return_exceptions=True)
    usable: dict[str, WorkerHandle] = {}
    dead: list[str] = []
    for ref, worker in zip(refs, made, strict=True):
        if isinstance(worker, WorkerHandle):
            usable[ref.name] = worker
            continue
        if isinstance(worker, ray.exceptions.ActorDiedError):
            dead.append(ref.name)
        log.warning("worker %s not taken: %r", ref.name, worker)
    return usable, dead
