"""The autoscaler's decisions, observation, leader lease and drain-only
retirement, with a fake clock, fake observations and a fake model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from planner.profile import Profile
from router.autoscaler import Policy, Targets
from router.autoscaler_lease import LeaderLease
from router.autoscaler_model import PlannerModel, Prediction
from router.autoscaler_observe import IDLE, Load, Observed, Observer
from router.backend import GenerateResult
from router.pool_controller import _drain_quiet

pytestmark = pytest.mark.unit

NONE_SEEN = Observed(None, None, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeModel:
    """TTFT grows with rate and backlog per prefill worker, TPOT with rate per decode worker."""

    def __init__(self) -> None:
        self.calls = 0

    def predict(self, load: Load, prefill: int, decode: int, quantile: float) -> Prediction:
        self.calls += 1
        ttft = 0.05 + 0.1 * load.rate_rps / prefill + 0.05 * load.backlog / prefill
        tpot = 0.01 + 0.004 * load.rate_rps / decode
        return Prediction(ttft, tpot)


def load(rate: float, backlog: int = 0) -> Load:
    return Load(rate, 256.0, 64.0, 0.0, backlog, samples=100)


def policy(**kw) -> Policy:
    targets = Targets(
        ttft_s=0.5,
        tpot_s=0.05,
        headroom=1.0,
        bounds={"prefill": (1, 8), "decode": (1, 8)},
        scale_down_delay_s=10.0,
        window_s=5.0,
        **kw,
    )
    return Policy(targets, FakeModel())


def test_fewest_workers_that_meet_both_targets():
    # rate 8: ttft 0.05 + 0.8/p <= 0.5 -> p >= 2 (0.45); tpot 0.01 + 0.032/d <= 0.05 -> d >= 1
    out = policy().decide(0.0, load(8), NONE_SEEN, {"prefill": 1, "decode": 1})
    assert out.target == {"prefill": 2, "decode": 1}
    (d,) = out.decisions
    assert (d.pool, d.current, d.target, d.direction) == ("prefill", 1, 2, "up")
    assert "ttft" in d.reason and "budget" in d.reason


def test_queue_backlog_asks_for_more_prefill_before_the_rate_does():
    p = policy()
    sizes = {"prefill": 2, "decode": 2}
    assert p.decide(0.0, load(8), NONE_SEEN, sizes).target["prefill"] == 2
    # the same rate with 10 prompts queued: 0.05 + (0.8 + 0.5) / p <= 0.5 -> p >= 3
    assert p.decide(1.0, load(8, backlog=10), NONE_SEEN, sizes).target["prefill"] == 3


def test_capped_at_the_most_and_kept_at_the_least():
    p = policy()
    out = p.decide(0.0, load(500), NONE_SEEN, {"prefill": 1, "decode": 1})
    assert out.target == {"prefill": 8, "decode": 8}
    assert "even at the most" in out.decisions[0].reason
    idle = policy().decide(0.0, IDLE, NONE_SEEN, {"prefill": 1, "decode": 1})
    assert idle.target == {"prefill": 1, "decode": 1} and not idle.decisions


def test_scale_down_waits_the_delay_and_takes_the_peak_meanwhile():
    p = policy()
    sizes = {"prefill": 6, "decode": 2}
    assert p.decide(0.0, load(1), NONE_SEEN, sizes).target["prefill"] == 6  # needs 1: waits
    assert p.decide(5.0, load(8), NONE_SEEN, sizes).target["prefill"] == 6  # needs 2: still low
    out = p.decide(10.0, load(1), NONE_SEEN, sizes)
    assert out.target["prefill"] == 2  # the most needed over the 10 s
    (d,) = [d for d in out.decisions if d.pool == "prefill"]
    assert d.direction == "down" and "sufficed for 10 s" in d.reason


def test_a_need_at_the_current_size_resets_the_delay():
    p = policy()
    sizes = {"prefill": 3, "decode": 1}
    p.decide(0.0, load(1), NONE_SEEN, sizes)
    p.decide(6.0, load(12), NONE_SEEN, sizes)  # needs 3 again: 0.05 + 1.2 / 3 <= 0.5
    assert p.decide(12.0, load(1), NONE_SEEN, sizes).target["prefill"] == 3  # delay restarted
    assert p.decide(22.0, load(1), NONE_SEEN, sizes).target["prefill"] == 1


def test_a_growth_under_way_keeps_its_target_through_the_delay():
    p = policy()
    sizes = {"prefill": 2, "decode": 1}
    assert p.decide(0.0, load(40), NONE_SEEN, sizes).target["prefill"] == 8  # workers start
    # The need dips while they start: the growth's target stays.
    out = p.decide(3.0, load(12), NONE_SEEN, sizes)
    assert out.target["prefill"] == 8
    (d,) = [d for d in out.decisions if d.pool == "prefill"]
    assert (d.current, d.target, d.direction) == (2, 8, "up")
    assert p.decide(8.0, load(8), NONE_SEEN, {"prefill": 4, "decode": 1}).target["prefill"] == 8
    # Lowered once the smaller need lasted the delay, to the most needed meanwhile
    # (3, at 3 s), from the 5 workers started by then.
    out = p.decide(13.0, load(8), NONE_SEEN, {"prefill": 5, "decode": 1})
    assert out.target["prefill"] == 3
    (d,) = [d for d in out.decisions if d.pool == "prefill"]
    assert (d.current, d.target, d.direction) == (5, 3, "down")


def test_observed_error_corrects_the_model_once_the_sizes_are_stable():
    p = policy()
    sizes = {"prefill": 2, "decode": 1}
    # predicted ttft at rate 8, p=2: 0.45 s; measured twice that
    slow = Observed(0.9, 0.042, samples=50)
    out = p.decide(0.0, load(8), slow, sizes)
    assert out.correction == {"ttft": 1.0, "tpot": 1.0}  # sizes just seen: not yet
    out = p.decide(6.0, load(8), slow, sizes)
    assert out.correction["ttft"] == pytest.approx(1.0 + 0.3 * (2.0 - 1.0))
    assert out.predicted.ttft_s == pytest.approx(0.45 * 1.3)
    # corrected budget 0.5 / 1.3: 0.05 + 0.8 / p <= 0.385 -> p >= 3
    assert out.target["prefill"] == 3


def test_a_building_queue_leaves_the_correction_alone():
    p = policy()
    sizes = {"prefill": 2, "decode": 1}
    p.decide(0.0, load(8, backlog=5), Observed(0.1, 0.01, samples=50), sizes)
    out = p.decide(6.0, load(8, backlog=5), Observed(0.1, 0.01, samples=50), sizes)
    assert out.correction == {"ttft": 1.0, "tpot": 1.0}


def test_too_few_samples_leave_the_correction_alone():
    p = policy()
    sizes = {"prefill": 2, "decode": 1}
    p.decide(0.0, load(8), Observed(5.0, 1.0, samples=3), sizes)
    out = p.decide(6.0, load(8), Observed(5.0, 1.0, samples=3), sizes)
    assert out.correction == {"ttft": 1.0, "tpot": 1.0}


def _result(prompt=100, cached=50, out=10, ttft=0.2, tpot=0.02) -> GenerateResult:
    return GenerateResult("length", prompt, cached, out, ttft, tpot, "p", "d")


def test_observer_rates_lengths_hits_and_quantiles():
    clock = Clock()
    obs = Observer(window_s=20.0, clock=clock)
    for i in range(40):  # one a second, each 1 s end to end
        clock.now = float(i + 1)
        obs.record(_result(ttft=0.1 + i / 100), e2e_s=1.0)
        obs.load(arrived=i + 1, backlog=0)  # a round a second
    clock.now = 40.0  # arrivals at 0..39
    got = obs.load(arrived=40, backlog=3)
    assert got.rate_rps == pytest.approx(1.0)
    assert (got.prompt_tokens, got.output_tokens, got.hit_rate) == (100, 10, 0.5)
    assert got.backlog == 3 and got.samples == 20
    seen = obs.observed(0.5)
    assert seen.samples == 20 and seen.ttft_s == pytest.approx(0.1 + 29.5 / 100)


def test_a_step_up_in_rate_shows_within_a_quarter_window_and_a_step_down_after_a_window():
    clock = Clock()
    obs = Observer(window_s=20.0, clock=clock)
    arrived = 0
    for t in range(1, 61):
        clock.now = float(t)
        arrived += 2 if t <= 30 else 10 if t <= 45 else 2
        rate = obs.load(arrived, backlog=0).rate_rps
        if t == 30:
            assert rate == pytest.approx(2.0)
        if t == 36:  # 6 s after the step: the last 5 s ran at 10 a second
            assert rate == pytest.approx(10.0)
        if t == 50:  # 5 s after the step down, the window still holds the peak
            assert rate > 6.0
        if t == 60:  # the window's: 5 s at 10 and 15 s at 2 (the last quarter's: 2)
            assert rate == pytest.approx((5 * 10 + 15 * 2) / 20)


def test_observer_ignores_aborted_and_empty_results():
    obs = Observer(window_s=10.0, clock=Clock())
    obs.record(GenerateResult("abort", 10, 0, 3, 0.1, 0.01, "p", "d"), 0.5)
    obs.record(_result(out=0), 0.5)
    assert obs.observed(0.9) == NONE_SEEN


def test_combined_load_adds_rates_and_takes_the_largest_backlog():
    a = Load(2.0, 100.0, 10.0, 0.0, 4, samples=10)
    b = Load(6.0, 300.0, 30.0, 0.5, 1, samples=30)
    both = Load.combined([a, b])
    assert both.rate_rps == 8.0 and both.backlog == 4 and both.samples == 40
    assert both.prompt_tokens == pytest.approx(250.0) and both.hit_rate == pytest.approx(0.375)
    assert Load.combined([]) == IDLE


def test_one_router_decides_until_its_lease_lapses():
    clock = Clock()
    lease = LeaderLease(clock)
    assert lease.turn("a", load(1), lease_s=10).leader
    turn = lease.turn("b", load(2), lease_s=10)
    assert not turn.leader and len(turn.loads) == 2
    clock.now = 8.0
    assert lease.turn("a", load(1), lease_s=10).leader
    clock.now = 19.0  # a silent for 11 s
    turn = lease.turn("b", load(2), lease_s=10)
    assert turn.leader and turn.loads == (load(2),)
    lease.leave("b")
    assert lease.turn("a", load(1), lease_s=10).leader


PROFILE = Profile(prefill={"a": 0.01, "b": 2e-4, "c": 0.0}, decode={"d": 0.02, "e": 1e-4, "f": 0.0})


def test_planner_model_falls_with_more_workers_and_counts_the_backlog():
    model = PlannerModel(PROFILE)
    heavy = Load(30.0, 256.0, 16.0, 0.0, 0, samples=100)
    one, four = (model.predict(heavy, p, 4, 0.95).ttft_s for p in (1, 4))
    assert four < one
    queued = model.predict(Load(30.0, 256.0, 16.0, 0.0, 40, samples=100), 4, 4, 0.95)
    assert queued.ttft_s > four
    # prefix hits shorten what prefill computes
    hit = model.predict(Load(30.0, 256.0, 16.0, 0.8, 0, samples=100), 1, 4, 0.95)
    assert hit.ttft_s < one
    assert model.predict(IDLE, 1, 1, 0.95) == Prediction(0.0, 0.0)


@dataclass
class _Stats:
    num_requests: int

    @property
    def holds_no_request(self) -> bool:
        return self.num_requests == 0


class _Remote:
    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def remote(self):
        async def answer():
            return _Stats(self.counts.pop(0) if len(self.counts) > 1 else self.counts[0])

        return answer()


class _Actor:
    def __init__(self, counts: list[int]) -> None:
        self.stats = _Remote(counts)


@dataclass
class _Worker:
    name: str
    actor: _Actor
    in_flight: int = 0


def test_a_retiring_worker_waits_until_it_has_been_empty_for_the_quiet_time(monkeypatch):
    monkeypatch.setattr("router.pool_controller.RETIRE_POLL_S", 0.01)
    busy = [2, 1, 0, 1, 0]  # empty, then a late request, then empty for good
    worker = _Worker("decode-aa", _Actor(busy))

    async def go() -> None:
        await asyncio.wait_for(_drain_quiet([worker], 0.05, lambda name, since: 0), 5)

    asyncio.run(go())
    assert worker.actor.stats.counts == [0]  # it kept asking through the late request


class _Members:
    def __init__(self, names: list[str]) -> None:
        self.known = {n: _Worker(n, None) for n in names}
        self.retiring: set[str] = set()

    def count(self, role: str) -> int:
        return sum(1 for n in self.known if n.startswith(role))


class _Pool:
    def __init__(self, role: str, members: _Members) -> None:
        self.role = role
        self.workers = [w for n, w in members.known.items() if n.startswith(role)]


class _Deployment:
    def __init__(self, backend) -> None:
        self.backend = backend
        self.lease = LeaderLease()
        self.retired: list[list[str]] = []

    async def call(self, method: str, *args):
        if method == "autoscale_turn":
            return self.lease.turn(*args)
        if method == "retire":
            _role, names = args
            self.retired.append(names)
            for name in names:
                self.backend.members.known.pop(name)
            pool = self.backend.pool_of(_role)
            pool.workers = [w for w in pool.workers if w.name not in names]
            return None
        if method == "autoscale_leave":
            return self.lease.leave(*args)
        raise AssertionError(method)


class _Backend:
    def __init__(self, names: list[str]) -> None:
        from router.config import ServeConfig

        self.config = ServeConfig(autoscale={"enabled": True, "scale_down_delay_s": 0})
        self.router_id = "router-a"
        self.members = _Members(names)
        self.prefill = _Pool("prefill", self.members)
        self.decode = _Pool("decode", self.members)
        self.deployment = _Deployment(self)
        self.changes = _Changes(self)
        self.scaled: list[tuple] = []

    def pool_of(self, role: str) -> _Pool:
        return self.prefill if role == "prefill" else self.decode

    async def worker_reports(self) -> list:
        return []

    async def scale(self, prefill, decode, drain_timeout_s: float = 30.0):
        raise AssertionError("the autoscaler grows through grow_to, never scale")


class _Changes:
    def __init__(self, backend: _Backend) -> None:
        self.backend = backend
        self.started = asyncio.Event()  # set by a test to hold a growth
        self.hold: asyncio.Event | None = None

    async def grow_to(self, role: str, n: int) -> int:
        b = self.backend
        if self.hold is not None:
            self.started.set()
            await self.hold.wait()
        b.scaled.append((n, None) if role == "prefill" else (None, n))
        while b.members.count(role) < n:
            name = f"{role}-{len(b.members.known):012x}"
            b.members.known[name] = _Worker(name, None)
            b.pool_of(role).workers.append(b.members.known[name])
        return b.members.count(role)


class _Sync(_Members):
    async def sync(self, members) -> None:
        return None


def test_the_runner_grows_in_steps_and_retires_by_draining():
    from router.autoscaler_runner import AutoscaleRunner
    from router.metrics import RouterMetrics

    names = ["prefill-000000000001", "decode-000000000002"]
    backend = _Backend(names)
    backend.members.__class__ = _Sync
    arrived = [0]
    clock = Clock()
    metrics = RouterMetrics()
    runner = AutoscaleRunner(backend, metrics, lambda: arrived[0], FakeModel(), clock)

    async def go() -> None:
        clock.now, arrived[0] = 1.0, 0
        await runner.tick()
        clock.now, arrived[0] = 2.0, 36  # 36 a second: 0.05 + 3.6 / p <= 0.85 * 1 s: p = 5
        out = await runner.tick()
        assert out.target["prefill"] == 5
        await asyncio.gather(*runner.growing.values())
        assert runner.sizes()["prefill"] == 5
        assert [p for p, _ in backend.scaled if p is not None] == [3, 5]  # two at a time
        for t in range(3, 30):  # no more arrivals: down to the minimum, by retiring
            clock.now = float(t)
            await runner.tick()
            await asyncio.gather(*runner.retiring.values(), *runner.growing.values())
        assert runner.sizes() == {"prefill": 1, "decode": 1}
        assert sum(len(n) for n in backend.deployment.retired) >= 4

    asyncio.run(go())
    text = metrics.render().decode()
    assert 'tandem_pool_target_workers{pool="prefill"} 1.0' in text
    assert 'tandem_autoscaler_decisions_total{direction="up",pool="prefill"} 1.0' in text


def test_a_router_that_loses_the_lease_stops_its_growth_and_reports_its_requests():
    from router.autoscaler_runner import AutoscaleRunner
    from router.metrics import RouterMetrics

    names = ["prefill-000000000001", "decode-000000000002"]
    backend = _Backend(names)
    backend.members.__class__ = _Sync
    backend.members.known["decode-000000000002"].in_flight = 3
    backend.changes.hold = asyncio.Event()  # the growth waits on its start
    arrived = [0]
    clock = Clock()
    runner = AutoscaleRunner(backend, RouterMetrics(), lambda: arrived[0], FakeModel(), clock)
    lease = backend.deployment.lease

    async def go() -> None:
        clock.now, arrived[0] = 1.0, 0
        await runner.tick()
        clock.now, arrived[0] = 2.0, 36
        await runner.tick()
        growth = runner.growing["prefill"]
        await backend.changes.started.wait()
        assert lease.routed("decode-000000000002", 0.0) == 3
        lease.leader = "router-b"  # another router took the lease (this one stalled)
        lease.turn("router-b", IDLE, 10.0, {})
        assert await runner.tick() is None
        with pytest.raises(asyncio.CancelledError):
            await growth
        assert backend.scaled == []  # no start went through after the lease was lost

    asyncio.run(go())


def test_the_model_counts_the_requests_decoding_now():
    """A decode pool that a drained queue filled steps slower than one fed at
    the arrival rate: the planner model starts them in its decode steps."""
    # A step of 25 ms + 12 ms a sequence (the rate step's profile).
    model = PlannerModel(Profile(prefill={"a": 0.02, "b": 6e-4, "c": 0.0},
                                 decode={"d": 0.025, "e": 0.012, "f": 0.0}))  # fmt: skip
    fed = Load(20.0, 512.0, 24.0, 0.0, backlog=0, samples=100)
    full = Load(20.0, 512.0, 24.0, 0.0, backlog=0, samples=100, decoding=130)
    assert model.predict(full, 8, 9, 0.95).tpot_s > 1.3 * model.predict(fed, 8, 9, 0.95).tpot_s
    assert Load.combined([fed, full]).decoding == 130
