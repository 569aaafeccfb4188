"""The autoscaler's loop in a router: observe, take the turn, decide, resize.

Every ``autoscale.interval_s`` the router reports its load to the
deployment's owner (router/autoscaler_lease.py); the router holding the
lease decides (router/autoscaler.py) on every router's load added up and
resizes, in the background so that neither a slow start nor a drain holds
up the next decision: it grows a pool through a grow-only call
(``WorkerChanges.grow_to``: never a removal), ``GROW_STEP`` workers at a
time (each step serves as soon as it has started, not once the last one
has), up to the latest target; and it shrinks one only by retiring workers
(``PoolController.retire``: out of routing on every router once they see
``Members.leaving``, stopped once no router and the worker itself hold
anything on it). A router that loses the lease stops its growths. Each
change is one structured log line (``autoscale_decision``) and the figures
behind it are metrics (router/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from router.autoscaler import Decision, Outcome, Policy, Targets
from router.autoscaler_model import LatencyModel
from router.autoscaler_observe import Load, Observer
from router.config import AutoscaleSection
from router.membership import role_of
from router.metrics import RouterMetrics
from worker.logfmt import log_event

if TYPE_CHECKING:
    from router.lifecycle import Lifecycle
    from router.ray_backend import RayBackend

log = logging.getLogger(__name__)

GROW_STEP = 2  # workers a pool grows by per start


def lifecycle_arrivals(lifecycle: Lifecycle) -> Callable[[], int]:
    """The requests that reached ``lifecycle``: finished (any status) and in flight."""
    stats = lifecycle.stats
    return lambda: sum(stats.totals.values()) + stats.in_flight


def targets_of(settings: AutoscaleSection, max_workers: int) -> Targets:
    bounds = {}
    for pool in ("prefill", "decode"):
        lo, hi = settings.bounds(pool)
        bounds[pool] = (lo, min(hi, max_workers))
    return Targets(
        ttft_s=settings.ttft_ms / 1e3,
        tpot_s=settings.tpot_ms / 1e3,
        quantile=settings.target_attainment,
        headroom=settings.headroom,
        bounds=bounds,
        scale_down_delay_s=settings.scale_down_delay_s,
        window_s=settings.window_s,
    )


class AutoscaleRunner:
    def __init__(
        self,
        backend: RayBackend,
        metrics: RouterMetrics,
        arrived: Callable[[], int],
        model: LatencyModel,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``arrived``: the requests that reached this router so far (finished
        and in flight: ``lifecycle_arrivals``)."""
        config = backend.config
        if config.pools.mode != "disaggregated":
            raise ValueError("autoscale: only disaggregated pools (pools.mode) are resized")
        self.backend = backend
        self.settings = config.autoscale
        self.metrics = metrics
        self.arrived = arrived
        self.clock = clock
        self.observer = Observer(self.settings.window_s, clock)
        metrics.result_listeners.append(self.observer.record)
        self.policy = Policy(targets_of(self.settings, config.pools.max_workers), model)
        self.retiring: dict[str, asyncio.Task] = {}  # one retirement at a time per pool
        self.growing: dict[str, asyncio.Task] = {}  # one growth at a time per pool
        self.wanted: dict[str, int] = {}  # the latest target per pool
        self.leaving: set[str] = set()  # workers this router retires, until they are gone
        self.outcomes: list[Outcome] = []  # the decisions made here (tests, benches)

    def sizes(self) -> dict[str, int]:
        """Members of each pool, less those retiring."""
        members = self.backend.members
        return {pool: members.count(pool) - self._retiring(pool) for pool in ("prefill", "decode")}

    def _retiring(self, pool: str) -> int:
        """Members of ``pool`` retiring (by this router, or seen leaving)."""
        names = (self.backend.members.retiring | self.leaving) & set(self.backend.members.known)
        return sum(1 for n in names if role_of(n) == pool)

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.settings.interval_s)
                try:
                    await self.tick()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("autoscale round failed; trying again")
        finally:
            for task in [*self.retiring.values(), *self.growing.values()]:
                task.cancel()
            with contextlib.suppress(Exception):
                await self.backend.deployment.call("autoscale_leave", self.backend.router_id)

    async def tick(self) -> Outcome | None:
        """One round; the outcome when this router decided, else None."""
        load = await self.load()
        turn = await self.backend.deployment.call(
            "autoscale_turn",
            self.backend.router_id,
            load,
            self.settings.leader_lease_s,
            self.in_flight(),
        )
        if not turn.leader:
            for task in self.growing.values():  # the new leader decides the sizes now
                task.cancel()
            return None
        sizes = self.sizes()
        observed = self.observer.observed(self.settings.target_attainment)
        load = Load.combined(turn.loads)
        # The simulations take a while: off the event loop that serves requests.
        outcome = await asyncio.to_thread(self.policy.decide, self.clock(), load, observed, sizes)
        self.outcomes.append(outcome)
        self._export(outcome, sizes)
        for decision in outcome.decisions:
            if self._under_way(decision):
                continue
            self._log(decision, outcome, load)
            await self._apply(decision)
        return outcome

    def in_flight(self) -> dict[str, int]:
        """This router's requests in flight on each member it knows (in
        routing or not): the owner retires a worker only once every router
        reports none on it."""
        known = self.backend.members.known
        return {name: w.in_flight for name, w in known.items() if w.in_flight}

    async def load(self) -> Load:
        """This router's load; the backlog: prompts on the prefill workers now;
        decoding: requests on the decode workers now."""
        reports = await self.backend.worker_reports()
        backlog = sum(r.stats.num_requests for r in reports if r.role == "prefill")
        decoding = sum(r.stats.num_requests for r in reports if r.role == "decode")
        return self.observer.load(self.arrived(), backlog, decoding)

    def _under_way(self, decision: Decision) -> bool:
        """The same target, still being reached (a growth or a retirement runs)."""
        tasks = self.growing if decision.direction == "up" else self.retiring
        task = tasks.get(decision.pool)
        running = task is not None and not task.done()
        return running and self.wanted.get(decision.pool) == decision.target

    async def _apply(self, decision: Decision) -> None:
        self.metrics.autoscale_decisions.labels(decision.pool, decision.direction).inc()
        self.wanted[decision.pool] = decision.target
        if decision.direction == "up":
            task = self.growing.get(decision.pool)
            if task is None or task.done():
                self.growing[decision.pool] = asyncio.create_task(self._grow(decision.pool))
            return
        # A growth under way stops after its current step (wanted is lower now).
        if decision.pool in self.retiring and not self.retiring[decision.pool].done():
            return  # the last retirement still drains; the next round decides again
        pool = self.backend.pool_of(decision.pool)
        count = min(decision.current - decision.target, len(pool.workers) - 1)
        if count <= 0:
            return
        # The least loaded, newest first; they leave routing once the owner
        # lists them leaving (router/member_sync.py), the one way out.
        order = sorted(reversed(pool.workers), key=lambda w: w.in_flight)
        names = [w.name for w in order[:count]]
        self.leaving |= set(names)
        task = asyncio.create_task(self._retire(decision.pool, names))
        self.retiring[decision.pool] = task

    async def _grow(self, pool: str) -> None:
        """Toward ``wanted[pool]``, GROW_STEP workers at a time."""
        try:
            while (now := self.sizes()[pool]) < self.wanted[pool]:
                total = min(self.wanted[pool], now + GROW_STEP) + self._retiring(pool)
                await self.backend.changes.grow_to(pool, total)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("growing the %s pool failed", pool)

    async def _retire(self, role: str, names: list[str]) -> None:
        try:
            members = await self.backend.deployment.call("retire", role, names)
            await self.backend.members.sync(members)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("retiring %s failed", names)
        finally:
            self.leaving -= set(names)

    def _export(self, outcome: Outcome, sizes: dict[str, int]) -> None:
        m = self.metrics
        for pool, n in outcome.target.items():
            m.pool_target.labels(pool).set(n)
        m.autoscale_latency.labels("ttft", "predicted").set(outcome.predicted.ttft_s)
        m.autoscale_latency.labels("tpot", "predicted").set(outcome.predicted.tpot_s)
        if outcome.observed.ttft_s is not None:
            m.autoscale_latency.labels("ttft", "observed").set(outcome.observed.ttft_s)
        if outcome.observed.tpot_s is not None:
            m.autoscale_latency.labels("tpot", "observed").set(outcome.observed.tpot_s)
        for kind, value in outcome.correction.items():
            m.autoscale_correction.labels(kind).set(value)

    def _log(self, decision: Decision, outcome: Outcome, load: Load) -> None:
        observed = outcome.observed

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1e3, 1)

        log_event(
            log,
            "autoscale_decision",
            pool=decision.pool,
            direction=decision.direction,
            current=decision.current,
            target=decision.target,
            reason=decision.reason,
            rate_rps=round(load.rate_rps, 2),
            prompt_tokens=round(load.prompt_tokens),
            output_tokens=round(load.output_tokens),
            hit_rate=round(load.hit_rate, 3),
            backlog=load.backlog,
            predicted_ttft_ms=ms(outcome.predicted.ttft_s),
            predicted_tpot_ms=ms(outcome.predicted.tpot_s),
            observed_ttft_ms=ms(observed.ttft_s),
            observed_tpot_ms=ms(observed.tpot_s),
            correction_ttft=round(outcome.correction["ttft"], 3),
            correction_tpot=round(outcome.correction["tpot"], 3),
        )
