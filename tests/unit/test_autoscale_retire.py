"""Retiring workers safely (router/pool_controller.py, router/autoscaler_lease.py):
a worker stops only once every router reports no request on it and its own
stats hold nothing, a hung one cannot block it, what is owed survives the
drain; and the one way into routing (router/member_sync.py ``enter``)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from protocol.workers import WorkerStats
from router.autoscaler_lease import LeaderLease
from router.autoscaler_observe import IDLE
from router.config import ServeConfig
from router.member_sync import MemberSync
from router.pool_controller import PoolController, _drain_quiet
from router.pool_manager import WorkerHandle, WorkerPool

pytestmark = pytest.mark.unit

EMPTY = WorkerStats(10, 10, 10, 1, 1, 0, 0, 0, 0, 0)


class Stats:
    """A stats remote answering from a list (the last one for good); None: hang."""

    def __init__(self, answers: list[WorkerStats | None]) -> None:
        self.answers = answers
        self.calls = 0

    def remote(self):
        self.calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

        async def go() -> WorkerStats:
            if answer is None:
                await asyncio.Event().wait()
            return answer

        return go()


def _worker(name: str, answers: list[WorkerStats | None]) -> WorkerHandle:
    return WorkerHandle(name, name.split("-")[0], SimpleNamespace(stats=Stats(answers)))


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr("router.pool_controller.RETIRE_POLL_S", 0.01)


def test_a_worker_stays_while_a_router_still_has_a_request_on_it():
    """Its own count is 0 from the start (a decode worker hears of a request
    only at the push header): the routers' counts hold it."""
    worker = _worker("decode-000000000001", [EMPTY])
    said = [None, None, 1, 1, 1, 0]  # no report since it left, then one in flight, then none

    def routed(name: str, since: float) -> int | None:
        return said.pop(0) if len(said) > 1 else said[0]

    asyncio.run(asyncio.wait_for(_drain_quiet([worker], 0.02, routed), 5))
    assert said == [0]


@pytest.mark.parametrize("field", ["num_requests", "num_expected_pushes", "num_transfer_leases"])
def test_a_request_an_expected_push_or_an_open_transfer_holds_a_worker(field):
    held = dataclasses.replace(EMPTY, **{field: 1})
    assert not held.holds_no_request and EMPTY.holds_no_request
    worker = _worker("decode-000000000001", [held, held, held, EMPTY])
    asyncio.run(asyncio.wait_for(_drain_quiet([worker], 0.02, lambda n, s: 0), 5))
    assert worker.actor.stats.answers == [EMPTY]  # it asked until the worker held nothing


def test_a_hung_worker_does_not_block_its_retirement(monkeypatch):
    monkeypatch.setattr("router.pool_controller.STATS_TIMEOUT_S", 0.02)
    worker = _worker("decode-000000000001", [None])
    asyncio.run(asyncio.wait_for(_drain_quiet([worker], 0.02, lambda n, s: 0), 5))
    assert worker.actor.stats.calls >= 2


def test_routed_counts_every_live_router_once_each_reported_since():
    clock = SimpleNamespace(now=0.0)
    lease = LeaderLease(lambda: clock.now)
    lease.turn("a", IDLE, 10.0, {"decode-1": 2})
    clock.now = 1.0
    lease.turn("b", IDLE, 10.0, {})
    assert lease.routed("decode-1", 0.5) is None  # a has not reported since 0.5
    clock.now = 2.0
    lease.turn("a", IDLE, 10.0, {"decode-1": 1})
    lease.turn("b", IDLE, 10.0, {"decode-1": 1})
    assert lease.routed("decode-1", 0.5) == 2
    clock.now = 13.0  # b lapses; a reports none
    lease.turn("a", IDLE, 10.0, {})
    assert lease.routed("decode-1", 12.0) == 0
    lease.leave("a")
    assert lease.routed("decode-1", 0.0) is None  # no live router: nobody can say


def _controller(monkeypatch, names: list[str]) -> PoolController:
    stopped: list[str] = []

    async def stop(workers) -> None:
        stopped.extend(w.name for w in workers)

    monkeypatch.setattr("router.pool_controller.stop_workers", stop)
    controller = PoolController(ServeConfig())
    controller.stopped = stopped
    controller.membership.add(names)
    for name in names:
        controller.handles[name] = _worker(name, [EMPTY])
    return controller


def test_a_replacement_owed_during_a_retirement_stays_owed(monkeypatch):
    names = ["decode-000000000001", "decode-000000000002"]
    controller = _controller(monkeypatch, names)
    gate = asyncio.Event()

    def routed(name: str, since: float) -> int | None:
        return 0 if gate.is_set() else None

    async def go() -> None:
        task = asyncio.create_task(controller.retire("decode", [names[0]], routed, 0.01))
        await asyncio.sleep(0.05)
        assert controller.members().leaving == {names[0]}
        controller.membership.lose([names[1]])  # lost while the first one drains
        gate.set()
        members = await asyncio.wait_for(task, 5)
        assert members.workers == () and not members.leaving

    asyncio.run(go())
    assert controller.stopped == [names[0]]
    assert controller.membership.owed() == {"decode": 1}


def test_a_retirement_called_off_puts_its_workers_back(monkeypatch):
    names = ["decode-000000000001"]
    controller = _controller(monkeypatch, names)

    async def go() -> None:
        task = asyncio.create_task(controller.retire("decode", names, lambda n, s: None, 0.01))
        await asyncio.sleep(0.05)
        assert controller.members().leaving == set(names)  # it was leaving: the call-off matters
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert not controller.members().leaving and controller.stopped == []


def _sync(names: list[str]) -> tuple[MemberSync, SimpleNamespace]:
    pools = {"decode": WorkerPool("decode")}
    down: set[str] = set()
    backend = SimpleNamespace(
        pool_of=lambda role: pools[role],
        recovery=SimpleNamespace(is_down=lambda w: w.name in down),
        down=down,
        decode=pools["decode"],
    )
    sync = MemberSync(backend)
    sync.known = {n: WorkerHandle(n, "decode", None) for n in names}
    return sync, backend


def test_enter_refuses_a_worker_down_retiring_gone_or_present():
    names = ["decode-000000000001", "decode-000000000002", "decode-000000000003"]
    sync, backend = _sync(names)
    one, two, three = (sync.known[n] for n in names)
    assert sync.enter(one) and not sync.enter(one)  # present: no duplicate
    backend.down.add(two.name)
    assert not sync.enter(two)
    sync._retiring(frozenset({three.name}))
    assert not sync.enter(three)
    assert not sync.enter(WorkerHandle("decode-000000000009", "decode", None))  # not a member
    backend.down.clear()
    sync._retiring(frozenset())  # the retirement called off: it comes back, once
    assert sync.enter(two)
    assert sorted(w.name for w in backend.decode.workers) == names


def test_a_worker_recovered_while_retiring_stays_out_of_routing():
    from router.failover import FailoverStats
    from router.worker_recovery import WorkerRecovery

    names = ["decode-000000000001"]
    sync, backend = _sync(names)
    worker = sync.known[names[0]]
    sync.enter(worker)

    async def nothing(w) -> None:
        return None

    async def go() -> None:
        recovery = WorkerRecovery(
            [backend.decode], nothing, nothing, FailoverStats(), poll_s=0.01, enter=sync.enter
        )
        backend.recovery = recovery

        async def healthy(w) -> bool:
            await asyncio.sleep(0.02)
            return True

        recovery._healthy = healthy
        recovery.suspect(worker, "test")
        sync._retiring(frozenset(names))  # it starts leaving while recovery watches it
        await recovery.wait_all(5)
        assert backend.decode.workers == []  # back and healthy, but retiring: not re-added
        sync._retiring(frozenset())
        assert backend.decode.workers == [worker]

    asyncio.run(go())


def test_the_autoscalers_model_is_the_deployments_as_tandem_plan_builds_it(tmp_path):
    import json

    from benchkit.autoscale_scenario import PROFILE
    from planner.settings import system_for
    from router.autoscaler_model import model_for

    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    config = ServeConfig(
        engine={"simulate": str(path), "kv_cache_memory_mb": 8, "max_num_seqs": 7},
        routing={"local_prefill_tokens": 64},
    )
    system = model_for(str(path), config).system
    assert system == system_for(config, PROFILE["kv_bytes_per_token"], simulated=True)
    assert system.max_decode_seqs == 7 and system.local_prefill_tokens == 64
    assert system.decode_kv_blocks == (8 << 20) // (PROFILE["kv_bytes_per_token"] * 16)
