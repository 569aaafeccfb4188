"""The one owner of a deployment's workers: it creates, replaces, resizes and
removes them, and keeps their membership (router/membership.py).

An ephemeral deployment (no ``deployment.name``) has one in the router's
process, whose workers die with it. A named one has one inside its
deployment actor (router/deployment.py), whose workers are detached named
actors in the deployment's namespace, shared by every router of the
deployment: changes go through it one at a time (one lock), so two routers
never both create or both replace a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from protocol.workers import WorkerInfo, WorkerStats
from router import health
from router.config import ServeConfig
from router.membership import Membership, new_worker_name
from router.pool_manager import (
    WorkerHandle,
    actor_class,
    create_worker,
    kill_worker,
    release_placement,
    start_workers,
    stop_workers,
)
from worker.cpu_binding import CoreAssignment, CoreLayout

log = logging.getLogger(__name__)

DEATH_CHECK_TIMEOUT_S = 10.0
# A retiring worker stops once it has held no request this long: longer than
# routers take to see it leave (router/member_sync.py, MEMBERSHIP_POLL_S, 1 s).
RETIRE_QUIET_S = 3.0
RETIRE_POLL_S = 0.2
STATS_TIMEOUT_S = 5.0  # one stats call of a retiring worker; past it, it counts as not answering

# Requests every live router has in flight on a worker, from their reports
# since a time (time.monotonic); None while one has not reported since.
Routed = Callable[[str, float], "int | None"]


@dataclass(frozen=True)
class WorkerRef:
    """A member as a router gets it: its name, role and actor handle."""

    name: str
    role: str
    actor: Any


@dataclass(frozen=True)
class Members:
    """The membership (router/membership.py) at one generation, with the
    members' actor handles: the one snapshot of it routers and tests get."""

    generation: str
    workers: tuple[WorkerRef, ...]
    draining: bool = False  # the deployment is going down: routers take no new request
    leaving: frozenset[str] = frozenset()  # retiring (drain-only): routers route nothing new


class PoolController:
    def __init__(
        self,
        config: ServeConfig,
        namespace: str | None = None,
        cores: CoreLayout | None = None,
        actor_classes: dict[str, type] | None = None,
    ) -> None:
        """``namespace``: the Ray namespace of a named deployment's detached
        workers; None: workers that die with this process. ``cores``: the
        machine's core layout the workers bind to; ``actor_classes``: actor
        classes to run instead of a role's own, by role."""
        self.config = config
        self.namespace = namespace
        roles = ("prefill", "decode", "colocated")
        self.cores = {r: CoreAssignment(cores, r) for r in roles} if cores is not None else {}
        self.actor_classes = dict(actor_classes or {})
        self.membership = Membership()
        self.handles: dict[str, WorkerHandle] = {}
        self.draining = False  # down() began: routers leave routing
        self.leaving: set[str] = set()  # retire() drains them: routers route nothing new
        self._lock = asyncio.Lock()

    # ---- what routers read ----------------------------------------------

    def generation(self) -> str:
        leaving = ":leaving:" + ",".join(sorted(self.leaving)) if self.leaving else ""
        return self.membership.generation + leaving + (":draining" if self.draining else "")

    def members(self) -> Members:
        members = self.membership.members.values()
        refs = tuple(WorkerRef(m.name, m.role, self.handles[m.name].actor) for m in members)
        return Members(self.generation(), refs, self.draining, frozenset(self.leaving))

    def busy(self) -> bool:
        """A change (a start, a scale, a replacement) is under way."""
        return self._lock.locked()

    # ---- changes, one at a time -----------------------------------------

    async def adopt(self, names: list[str]) -> Members:
        """Take over running workers (a deployment actor that Ray restarted
        finds its workers by name). One that does not answer its info is
        killed, and its role owed a replacement."""
        async with self._lock:
            found = Membership.from_names(names)
            for member in found.members.values():
                actor = None
                try:
                    actor = ray.get_actor(member.name, namespace=self.namespace)
                    info: WorkerInfo = await asyncio.wait_for(actor.info.remote(), 30)
                except Exception as exc:
                    log.warning("not adopting %s (%r): a replacement is owed", member.name, exc)
                    if actor is not None:
                        with contextlib.suppress(Exception):
                            ray.kill(actor, no_restart=True)
                    release_placement(member.name)
                    self.membership.owe(member.role)
                    continue
                self.handles[member.name] = WorkerHandle(member.name, member.role, actor, info)
                self._claim_cores(member.role, member.name)
                self.membership.add([member.name])
            return self.members()

    async def ensure(self, sizes: dict[str, int], timeout_s: float | None) -> Members:
        """At least ``sizes[role]`` workers of each role (a new deployment, or
        one whose router restarted: those running are kept)."""
        async with self._lock:
            wanted = {role: n - self.membership.count(role) for role, n in sizes.items()}
            await self._grow_all(wanted, timeout_s)
            return self.members()

    async def grow(self, role: str, n: int, timeout_s: float | None) -> Members:
        """``n`` workers of ``role`` in all (n above the current count)."""
        async with self._lock:
            self.membership.resize(role)
            await self._grow(role, n - self.membership.count(role), timeout_s)
            return self.members()

    async def remove(self, names: list[str]) -> Members:
        """Stop and remove workers (a router drained its requests on them first)."""
        async with self._lock:
            gone = [self.handles.pop(n) for n in self.membership.remove(names)]
            for worker in gone:
                self._release_cores(worker)
            await stop_workers(gone)
            return self.members()

    async def shrink(self, role: str, names: list[str]) -> Members:
        """``remove`` for an explicit new size of ``role``: what was owed to it is settled."""
        self.membership.resize(role)
        return await self.remove(names)

    async def retire(
        self,
        role: str,
        names: list[str],
        routed: Routed | None = None,
        quiet_s: float = RETIRE_QUIET_S,
    ) -> Members:
        """Drain-only removal, for an explicit new size of ``role`` (what was
        owed to it is settled now, not after the drain: a worker lost during
        it is still owed a replacement): the workers leave routing at once
        (``Members.leaving``), and each stops only once, for ``quiet_s``, its
        own stats show nothing held (``WorkerStats.holds_no_request``) and
        ``routed`` (every live router's requests in flight on it, None while
        one has not reported since) says none, however long that takes: no
        request on it fails. Other changes go on meanwhile."""
        async with self._lock:
            names = [n for n in names if self.membership.has(n) and n not in self.leaving]
            self.membership.resize(role)
            self.leaving |= set(names)
            workers = [self.handles[n] for n in names]
        try:
            await _drain_quiet(workers, quiet_s, routed or _no_routers)
        except BaseException:  # not drained (cancelled): they stay, in routing again
            self.leaving -= set(names)
            raise
        async with self._lock:
            self.leaving -= set(names)
            gone = [self.handles.pop(n) for n in self.membership.remove(names)]
            for worker in gone:
                self._release_cores(worker)
            await stop_workers(gone)
            return self.members()

    async def lost(self, names: list[str]) -> Members:
        """Routers report workers lost. Each one Ray reports dead for good leaves
        and its role is owed a replacement; a live one, or one already
        replaced (another router reported it first), changes nothing."""
        async with self._lock:
            known = [self.handles[n] for n in names if self.membership.has(n)]
            states = await asyncio.gather(*(health.check(w, DEATH_CHECK_TIMEOUT_S) for w in known))
            dead = [w for w, s in zip(known, states, strict=True) if s is health.Health.DEAD]
            for member in self.membership.lose([w.name for w in dead]):
                worker = self.handles.pop(member.name)
                self._release_cores(worker)
                release_placement(member.name)
                log.warning("worker %s died for good; a replacement is owed", member.name)
            return self.members()

    async def replace_owed(self, timeout_s: float | None) -> Members:
        """Start the replacements owed; those that cannot be placed within
        ``timeout_s`` stay owed (the next call tries again)."""
        async with self._lock:
            for role, n in self.membership.owed().items():
                try:
                    await self._grow(role, n, timeout_s)
                except Exception as exc:
                    log.warning("%d %s workers not placed yet: %r", n, role, exc)
                    continue
                self.membership.replaced(role, n)
            return self.members()

    async def down(self, drain_timeout_s: float) -> list[str]:
        """Wait (up to ``drain_timeout_s``) until no worker has a request, then
        stop and remove every one. Returns their names. Routers see it draining
        (``Members.draining``) and route no new request to its workers."""
        self.draining = True
        async with self._lock:
            workers = list(self.handles.values())
            await _drain(workers, drain_timeout_s)
            self.membership.remove([w.name for w in workers])
            self.handles.clear()
            await stop_workers(workers)
            return [w.name for w in workers]

    # ---- internals ------------------------------------------------------

    async def _grow(self, role: str, n: int, timeout_s: float | None) -> None:
        await self._grow_all({role: n}, timeout_s)

    async def _grow_all(self, wanted: dict[str, int], timeout_s: float | None) -> None:
        """``wanted[role]`` new workers of each role, started together; all or none."""
        new: list[WorkerHandle] = []
        try:
            for role, n in wanted.items():
                cls = actor_class(role, self.actor_classes.get(role))
                for _ in range(max(0, n)):
                    name = new_worker_name(role)
                    cores = self._claim_cores(role, name)
                    try:
                        worker = create_worker(self.config, role, name, cls, self.namespace, cores)
                    except BaseException:
                        self._release_cores(WorkerHandle(name, role, None))
                        raise
                    new.append(worker)
            if not new:
                return
            await start_workers(new, timeout_s)
        except BaseException:
            for worker in new:
                self._release_cores(worker)
                kill_worker(worker)
            raise
        for worker in new:
            self.handles[worker.name] = worker
        self.membership.add([w.name for w in new])

    def _claim_cores(self, role: str, name: str) -> tuple[int, ...] | None:
        assignment = self.cores.get(role)
        return None if assignment is None else assignment.claim(name)

    def _release_cores(self, worker: WorkerHandle) -> None:
        assignment = self.cores.get(worker.role)
        if assignment is not None:
            assignment.release(worker.name)


async def _drain(workers: list[WorkerHandle], timeout_s: float) -> None:
    """Until no worker has a request (by its own count), or the timeout."""
    if timeout_s <= 0 or not workers:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        stats = await asyncio.gather(
            *(w.actor.stats.remote() for w in workers), return_exceptions=True
        )
        if all(isinstance(s, BaseException) or s.num_requests == 0 for s in stats):
            return
        await asyncio.sleep(0.2)
    log.warning("drain timed out after %.1f s; stopping the workers anyway", timeout_s)


def _no_routers(worker: str, since: float) -> int | None:
    return 0


async def _stats(worker: WorkerHandle) -> WorkerStats:
    return await asyncio.wait_for(worker.actor.stats.remote(), STATS_TIMEOUT_S)


async def _drain_quiet(workers: list[WorkerHandle], quiet_s: float, routed: Routed) -> None:
    """Until, for ``quiet_s``, every worker holds nothing by its own stats and
    by the routers' counts (``routed``), taken from reports made ``quiet_s``
    after the start at the earliest (every router has seen the workers leave
    routing by then). A worker whose stats fail or take over STATS_TIMEOUT_S
    (dead, or hung) counts as holding nothing itself; the routers' counts
    still hold it while they have a request on it."""
    seen_from = time.monotonic() + quiet_s
    quiet_since: dict[str, float] = {}
    while True:
        stats = await asyncio.gather(*(_stats(w) for w in workers), return_exceptions=True)
        now = time.monotonic()
        for worker, s in zip(workers, stats, strict=True):
            empty = isinstance(s, BaseException) or s.holds_no_request
            if empty and routed(worker.name, seen_from) == 0:
                quiet_since.setdefault(worker.name, now)
            else:
                quiet_since.pop(worker.name, None)
        if all(now - quiet_since.get(w.name, now + 1) >= quiet_s for w in workers):
            return
        await asyncio.sleep(RETIRE_POLL_S)
