"""A worker that failed leaves routing at once and comes back only after its
health check passes; a restarted actor is started again first, and a worker
whose steps failed comes back once the failures are old."""

from __future__ import annotations

import asyncio

import pytest
import ray

from engine import EngineConfig
from protocol.workers import FAILING_WINDOW_S, UNHEALTHY_FAILED_STEPS, WorkerHealth, WorkerInfo
from router import health
from router.failover import FailoverStats, WorkerLost
from router.health import Health
from router.pool_manager import WorkerHandle
from router.watchdog import Watchdog
from router.worker_recovery import WorkerRecovery
from router.worker_streams import LOST
from tests.unit.test_request_faults import Clock, fail_steps
from worker.base import EngineWorker

pytestmark = pytest.mark.unit


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


def info(incarnation: str, outputs: str) -> WorkerInfo:
    return WorkerInfo("w", 64, 100, "fp", incarnation, "/model", outputs=outputs)


class FakeActor:
    """Answers like a worker actor: dead, restarted (not started) or healthy."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "healthy"  # "dead" | "restarted" | "healthy"
        self.incarnation = "first"
        self.starts = 0
        self.health_checks = 0
        self.health = _Method(self._health)
        self.start = _Method(self._start)

    async def _health(self) -> WorkerHealth:
        self.health_checks += 1
        if self.state == "dead":
            raise ConnectionError("actor died")
        if self.state == "gone":  # Ray: dead for good, no restart will come
            raise ray.exceptions.ActorDiedError()
        if self.state == "hung":
            await asyncio.sleep(3600)
        started = self.state == "healthy"
        return WorkerHealth(self.name, self.incarnation, started, 10, 10, 0)

    async def _start(self) -> WorkerInfo:
        self.starts += 1
        self.state = "healthy"
        return info(self.incarnation, f"{self.name}:new")


class FakePool:
    def __init__(self, workers) -> None:
        self.workers = list(workers)


def _setup():
    a, b = FakeActor("a"), FakeActor("b")
    wa = WorkerHandle("a", "decode", a, info("first", "a:old"))
    wb = WorkerHandle("b", "decode", b, info("first", "b:old"))
    pool = FakePool([wa, wb])
    events: list[tuple[str, str]] = []

    async def on_down(w):
        events.append(("down", w.name))

    async def on_back(w):
        events.append(("back", w.info.outputs))

    recovery = WorkerRecovery([pool], on_down, on_back, FailoverStats(), poll_s=0.01)
    return recovery, pool, wa, wb, events


def test_restarted_worker_comes_back_started_after_its_health_check():
    async def run():
        recovery, pool, wa, wb, events = _setup()
        wa.actor.state = "dead"
        recovery.suspect(wa, "stream broke")
        recovery.suspect(wa, "stream broke again")  # one watcher only
        assert pool.workers == [wb] and recovery.is_down(wa)
        async with asyncio.timeout(5):  # three failed health checks (or a wrong return)
            while wa.actor.health_checks < 3 and recovery.is_down(wa):
                await asyncio.sleep(0.01)
        assert pool.workers == [wb] and recovery.is_down(wa)  # still dead: stays out
        wa.actor.state, wa.actor.incarnation = "restarted", "second"
        await recovery.wait_all(5)
        assert pool.workers == [wb, wa] and not recovery.is_down(wa)
        assert wa.actor.starts == 1 and wa.info.incarnation == "second"
        assert events == [("down", "a"), ("back", "a:new")]
        assert (recovery.stats.workers_lost, recovery.stats.workers_recovered) == (1, 1)

    asyncio.run(run())


def test_a_live_worker_goes_back_as_it_was():
    async def run():
        recovery, pool, wa, wb, events = _setup()
        recovery.suspect(wb, "transfer failed")
        await recovery.wait_all(5)
        assert pool.workers == [wa, wb] and wb.actor.starts == 0
        assert events == [("down", "b"), ("back", "b:old")]

    asyncio.run(run())


def test_a_worker_that_never_answers_is_forgotten(monkeypatch):
    killed = []
    monkeypatch.setattr("router.worker_recovery.ray.kill", killed.append)

    async def run():
        recovery, pool, wa, wb, _ = _setup()
        recovery.recovery_timeout_s = 0.1
        wa.actor.state = "dead"
        recovery.suspect(wa, "gone")
        await recovery.wait_all(5)
        assert pool.workers == [wb] and killed == [wa.actor] and not recovery.is_down(wa)

    asyncio.run(run())


def test_a_shared_worker_given_up_is_reported_not_killed(monkeypatch):
    """A named deployment's worker serves other routers: this router's view
    failing is no reason to kill it; the owner judges what it is told."""
    killed, lost = [], []
    monkeypatch.setattr("router.worker_recovery.ray.kill", killed.append)

    async def run():
        recovery, pool, wa, wb, _ = _setup()
        recovery.kill_lost, recovery.recovery_timeout_s = False, 0.1
        recovery.on_lost = lambda worker, p: lost.append(worker.name)
        wa.actor.state = "dead"
        recovery.suspect(wa, "its stream broke")
        await recovery.wait_all(5)
        assert pool.workers == [wb] and killed == [] and lost == ["a"]

    asyncio.run(run())


def test_a_worker_dead_for_good_is_given_up_at_once_and_reported(monkeypatch):
    killed, lost = [], []
    monkeypatch.setattr("router.worker_recovery.ray.kill", killed.append)

    async def run():
        recovery, pool, wa, wb, _ = _setup()
        recovery.on_lost = lambda worker, p: lost.append((worker.name, p))
        wa.actor.state = "gone"
        recovery.suspect(wa, "its node went away")
        await recovery.wait_all(5)  # well before recovery_timeout_s (120 s)
        assert pool.workers == [wb] and killed == [wa.actor] and not recovery.is_down(wa)
        assert lost == [("a", pool)]

    asyncio.run(run())


def test_watchdog_waits_on_a_busy_worker_and_fails_over_from_a_hung_one():
    async def run():
        recovery, pool, wa, wb, _ = _setup()
        dog = Watchdog(recovery, stall_check_s=0.02, health_timeout_s=0.05)
        queue = asyncio.Queue()
        asyncio.get_running_loop().call_later(0.2, queue.put_nowait, "delta")
        assert await dog.next_delta(queue, wa) == "delta"  # silent but healthy: waited
        assert pool.workers == [wa, wb]
        wa.actor.state = "hung"
        assert await dog.next_delta(queue, wa) is LOST
        assert recovery.is_down(wa) and pool.workers == [wb]
        wb.actor.state = "hung"
        with pytest.raises(WorkerLost):
            await dog.call(wb, asyncio.sleep(3600))  # a call that never returns
        assert pool.workers == []
        assert await dog.call(wa, asyncio.sleep(0, "x")) == "x"  # answered in time
        await recovery.close()

    asyncio.run(run())


def test_a_worker_out_of_routing_for_failing_steps_comes_back_once_they_are_old(
    llama_dir, monkeypatch
):
    """A real worker whose steps failed (a lost device) answers failing and
    leaves routing; out of routing it runs no step that could pass. Once its
    failures are FAILING_WINDOW_S old (an injected clock) it answers healthy
    and the recovery watcher takes it back."""
    killed = []
    monkeypatch.setattr("router.worker_recovery.ray.kill", killed.append)

    async def run():
        worker = EngineWorker("w", EngineConfig(model=str(llama_dir), num_kv_blocks=64))
        worker.engine.clock = clock = Clock()
        answers: list[bool] = []
        three_failing = asyncio.Event()

        async def answer() -> WorkerHealth:
            reply = await worker.health()
            answers.append(reply.failing)
            if answers.count(True) >= 3:
                three_failing.set()
            return reply

        actor = type("EngineActor", (), {})()
        actor.health = _Method(answer)
        handle = WorkerHandle("w", "decode", actor, info(worker.incarnation, "w:out"))
        pool = FakePool([handle])
        events = []

        async def on_down(w):
            events.append("down")

        async def on_back(w):
            events.append("back")

        recovery = WorkerRecovery(
            [pool], on_down, on_back, FailoverStats(), poll_s=0.01, recovery_timeout_s=30
        )
        worker.start_loop()
        try:
            await fail_steps(worker, UNHEALTHY_FAILED_STEPS)
            assert await health.check(handle, 10) is Health.FAILING
            recovery.suspect(handle, "its steps keep failing")
            async with asyncio.timeout(30):
                await three_failing.wait()  # the watcher asked, and it stayed failing
            assert pool.workers == [] and recovery.is_down(handle)
            clock.now += FAILING_WINDOW_S  # idle all along
            await recovery.wait_all(40)
            assert pool.workers == [handle] and not recovery.is_down(handle)
            assert answers[-1] is False and killed == []
            assert events == ["down", "back"]
            assert worker.stats().idle
        finally:
            worker.stop_loop()

    asyncio.run(run())
