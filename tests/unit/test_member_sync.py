"""MemberSync.connect: a router starts on the members that answer and are
started, reports the dead ones to the owner, and fails only when a role it
needs has no usable worker (router/member_sync.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import ray

from protocol.workers import WorkerInfo
from router.config import ServeConfig
from router.member_sync import MemberSync
from router.pool_controller import Members, WorkerRef

pytestmark = pytest.mark.unit


class Actor:
    def __init__(self, name: str, started: bool = True, dead: bool = False) -> None:
        info = WorkerInfo(name, 64, 100, "fp", "inc", "/m", started=started)

        async def answer() -> WorkerInfo:
            if dead:
                raise ray.exceptions.ActorDiedError()
            return info

        self.info = SimpleNamespace(remote=answer)


class Owner:
    def __init__(self, after: Members) -> None:
        self.after = after
        self.calls: list[tuple] = []

    async def call(self, method: str, *args):
        self.calls.append((method, *args))
        return self.after


def _backend(owner: Owner, colocated: bool = False):
    config = ServeConfig(deployment={"name": "t"})
    decode = SimpleNamespace(role="colocated" if colocated else "decode")
    return SimpleNamespace(config=config, deployment=owner, decode=decode, colocated=colocated)


def _members(gen: str, *refs: WorkerRef) -> Members:
    return Members(gen, tuple(refs))


def test_connect_skips_a_worker_not_started_and_leaves_it_to_the_poll():
    refs = [
        WorkerRef("prefill-000000000001", "prefill", Actor("p")),
        WorkerRef("decode-000000000001", "decode", Actor("d1")),
        WorkerRef("decode-000000000002", "decode", Actor("d2", started=False)),
    ]
    owner = Owner(_members("g1"))
    sync = MemberSync(_backend(owner))
    handles = asyncio.run(sync.connect(_members("g0", *refs)))
    assert sorted(h.name for h in handles) == ["decode-000000000001", "prefill-000000000001"]
    assert sync.generation is None  # the poll takes the missing one later
    assert owner.calls == []  # nothing dead to report


def test_connect_reports_a_dead_worker_and_takes_its_replacement():
    prefill = WorkerRef("prefill-000000000001", "prefill", Actor("p"))
    dead = WorkerRef("decode-000000000001", "decode", Actor("d", dead=True))
    new = WorkerRef("decode-000000000002", "decode", Actor("d2"))
    owner = Owner(_members("g2", prefill, new))
    sync = MemberSync(_backend(owner))
    handles = asyncio.run(sync.connect(_members("g1", prefill, dead)))
    assert sorted(h.name for h in handles) == [new.name, prefill.name]
    assert [c[0] for c in owner.calls] == ["lost", "replace_owed"]
    assert owner.calls[0][1] == [dead.name]
    assert sync.generation == "g2"


def test_connect_fails_naming_the_role_without_a_usable_worker():
    prefill = WorkerRef("prefill-000000000001", "prefill", Actor("p"))
    dead = WorkerRef("decode-000000000001", "decode", Actor("d", dead=True))
    owner = Owner(_members("g2", prefill))  # no replacement placed
    sync = MemberSync(_backend(owner))
    with pytest.raises(RuntimeError, match=r"no usable decode worker.*tandem down --deployment t"):
        asyncio.run(sync.connect(_members("g1", prefill, dead)))


def test_a_colocated_deployment_needs_no_prefill_worker():
    ref = WorkerRef("colocated-000000000001", "colocated", Actor("c"))
    sync = MemberSync(_backend(Owner(_members("g1")), colocated=True))
    assert [h.name for h in asyncio.run(sync.connect(_members("g1", ref)))] == [ref.name]
    assert sync.generation == "g1"


def test_lost_workers_are_kept_until_the_owner_has_them():
    from router.ray_backend import RayBackend

    class Failing:
        async def call(self, method: str, *args):
            raise ConnectionError("the owner is restarting")

    async def run():
        backend = RayBackend(ServeConfig())
        backend.deployment = Failing()
        backend.changes.lost = {"decode-000000000001"}
        with pytest.raises(ConnectionError):
            await backend.replace_dead_workers()
        assert backend.changes.lost == {"decode-000000000001"}  # reported on the next check
        backend.deployment = Owner(_members("g1"))
        backend.members.generation = "g1"
        await backend.replace_dead_workers()
        assert backend.changes.lost == set()
        assert backend.deployment.calls[0] == ("lost", ["decode-000000000001"])

    asyncio.run(run())


def test_a_deployment_going_down_leaves_routing():
    ref = WorkerRef("decode-000000000001", "decode", Actor("d"))
    backend = _backend(Owner(_members("g1")))
    backend.prefill = SimpleNamespace(workers=["p"])
    backend.decode.workers = ["d"]
    sync = MemberSync(backend)
    sync.generation = "g1"
    asyncio.run(sync.sync(Members("g1:draining", (ref,), draining=True)))
    assert backend.prefill.workers == [] and backend.decode.workers == []
    assert sync.generation == "g1:draining"
