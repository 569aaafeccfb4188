"""The autoscaler's rate step, shared by tests/integration/test_autoscale.py
and bench/autoscale.py: a seeded trace (a rate that steps up and back
down), its open-loop replay against a deployment in this process with the
pool sizes sampled as it runs, and the planner's figures for the same trace
(the cheapest fixed split that meets the targets, the best split of a
given size).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from planner.profile import Profile
from planner.simulator import SystemConfig, simulate
from planner.trace import Trace as PlannerTrace
from planner.trace import TraceRequest
from router.client import TandemClient

SIZE_SAMPLE_S = 0.25


@dataclass(frozen=True)
class Trace:
    """Arrival times (s from the start) and fixed prompt and output lengths."""

    arrivals: tuple[float, ...]
    prompt_len: int
    output_len: int
    seed: int = 0

    @staticmethod
    def steps(
        phases: Sequence[tuple[float, float]], prompt_len: int, output_len: int, seed: int = 0
    ) -> Trace:
        """Poisson arrivals at ``rate`` for ``duration_s``, phase after phase."""
        rng = random.Random(seed)
        out, start = [], 0.0
        for rate, duration_s in phases:
            t = start + rng.expovariate(rate)
            while t < start + duration_s:
                out.append(t)
                t += rng.expovariate(rate)
            start += duration_s
        return Trace(tuple(out), prompt_len, output_len, seed)

    def prompt(self, i: int) -> list[int]:
        """Request ``i``'s prompt: its own first tokens (no prefix shared across requests)."""
        rng = random.Random(self.seed * 1_000_003 + i)
        return [rng.randrange(10, 30000) for _ in range(self.prompt_len)]

    def planner_trace(self) -> PlannerTrace:
        """The same trace for the planner (prompts sharing nothing, as here)."""
        requests = (
            TraceRequest(t, (i + 1,) * self.prompt_len, self.output_len)
            for i, t in enumerate(self.arrivals)
        )
        return PlannerTrace("autoscale-step", tuple(requests))


@dataclass
class Replay:
    """What one replay of a trace measured."""

    ttft_s: list[float | None]  # per request; None: it failed
    tpot_s: list[float | None]
    tokens: list[list[int] | None]
    errors: list[str]
    sizes: list[tuple[float, int, int]] = field(default_factory=list)  # (t, prefill, decode)
    duration_s: float = 0.0

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        ok = sum(
            1
            for ttft, tpot in zip(self.ttft_s, self.tpot_s, strict=True)
            if ttft is not None and tpot is not None and ttft <= ttft_slo_s and tpot <= tpot_slo_s
        )
        return ok / len(self.ttft_s)

    @property
    def worker_seconds(self) -> float:
        """The pools' sizes (retiring workers included) integrated over the run."""
        total = 0.0
        for (t0, p, d), (t1, _, _) in zip(self.sizes, self.sizes[1:], strict=False):
            total += (p + d) * (t1 - t0)
        return total

    @property
    def mean_workers(self) -> float:
        span = self.sizes[-1][0] - self.sizes[0][0] if len(self.sizes) > 1 else 0.0
        return self.worker_seconds / span if span > 0 else 0.0


async def _replay(address: str, trace: Trace, replay: Replay) -> None:
    async with TandemClient(address) as client:

        async def one(i: int) -> None:
            try:
                out = await client.complete(
                    trace.prompt(i), temperature=0, max_tokens=trace.output_len, ignore_eos=True
                )
            except Exception as exc:
                replay.errors.append(f"request {i}: {exc!r}")
                return
            replay.ttft_s[i] = out.timings.ttft_s
            replay.tpot_s[i] = out.timings.mean_tpot_s
            replay.tokens[i] = list(out.token_ids)

        start = time.monotonic()
        tasks = []
        for i, t in enumerate(trace.arrivals):
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)


def replay(address: str, trace: Trace, sizes: Callable[[], tuple[int, int]]) -> Replay:
    """Replay ``trace`` open loop (each request at its time, whatever came
    before), sampling ``sizes()`` (prefill, decode) meanwhile."""
    n = len(trace.arrivals)
    result = Replay([None] * n, [None] * n, [None] * n, [])
    done = threading.Event()
    start = time.monotonic()

    def sample() -> None:
        while not done.is_set():
            result.sizes.append((time.monotonic() - start, *sizes()))
            done.wait(SIZE_SAMPLE_S)
        result.sizes.append((time.monotonic() - start, *sizes()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(_replay(address, trace, result))
    finally:
        done.set()
        sampler.join()
    result.duration_s = time.monotonic() - start
    return result


def simulated(
    profile: Profile,
    system: SystemConfig,
    trace: Trace,
    prefill: int,
    decode: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> float:
    """The planner's attainment of ``trace`` on a fixed split of ``system``
    (the deployment's, planner/settings.py ``system_for``)."""
    res = simulate(
        trace.planner_trace(),
        replace(system, num_prefill=prefill, num_decode=decode),
        profile.prefill_s,
        profile.decode_step_s,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        step_cost=profile.step_s,
    )
    return res.attainment


def best_split(
    profile: Profile,
    system: SystemConfig,
    trace: Trace,
    total: int,
    ttft_slo_s: float,
    tpot_slo_s: float,
) -> tuple[int, int, float]:
    """The (prefill, decode) of ``total`` workers the planner rates best on
    ``trace`` (attainment rises, then falls, with the prefill share: a
    ternary search; ties: fewer prefill workers)."""
    scores: dict[int, float] = {}

    def score(p: int) -> float:
        if p not in scores:
            scores[p] = simulated(profile, system, trace, p, total - p, ttft_slo_s, tpot_slo_s)
        return scores[p]

    lo, hi = 1, total - 1
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if score(a) >= score(b):
            hi = b
        else:
            lo = a
    p = max(range(lo, hi + 1), key=lambda p: (score(p), -p))
    return p, total - p, score(p)


def cheapest_fixed(
    profile: Profile,
    system: SystemConfig,
    trace: Trace,
    ttft_slo_s: float,
    tpot_slo_s: float,
    target: float = 0.95,
    max_workers: int = 40,
) -> tuple[int, int, float]:
    """The fewest workers in a fixed split the planner finds meeting ``target``
    on ``trace`` (a binary search over the total)."""
    found = best_split(profile, system, trace, max_workers, ttft_slo_s, tpot_slo_s)
    if found[2] < target:
        raise ValueError(f"no fixed split of up to {max_workers} workers meets {target:.0%}")
    lo, hi = 2, max_workers
    while lo < hi:
        mid = (lo + hi) // 2
        split = best_split(profile, system, trace, mid, ttft_slo_s, tpot_slo_s)
        if split[2] >= target:
            hi, found = mid, split
        else:
            lo = mid + 1
    return found
