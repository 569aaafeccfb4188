"""The autoscaler's rate step on the simulated engine (what
tests/integration/test_autoscale.py asserts and bench/autoscale.py prints):
one deployment, replays of one trace.

1. Autoscaled: the pools start at their minimum and the autoscaler
   (router/autoscaler_runner.py) runs in the router; once the pools are
   back at their minimum, the trace's first requests again (same outputs).
2. Fixed (bench/autoscale.py only): the autoscaler stopped, the pools set
   to the planner's best split of the autoscaled run's mean worker count,
   the same trace again.

The planner's cheapest fixed split meeting the targets on the same trace is
the worker-seconds baseline.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

from benchkit.autoscale_run import Replay, Trace, best_split, cheapest_fixed, replay
from benchkit.deployment import Deployment
from planner.profile import Profile
from planner.settings import system_for
from router.autoscaler_model import model_for
from router.autoscaler_runner import AutoscaleRunner, lifecycle_arrivals
from router.config import ServeConfig

# A GPU-class model, simulated: tens of ms a step, so that this machine's
# noise (ms) is small beside it. A prompt of 512 tokens takes 0.33 s; a
# decode step 25 ms + 12 ms per sequence.
PROFILE = {
    "version": 1,
    "model": "autoscale-test",
    "prefill": {"a": 0.02, "b": 0.0006, "c": 0.0},
    "decode": {"d": 0.025, "e": 0.012, "f": 0.0},
    "kv_bytes_per_token": 4096,
    "vocab_size": 32000,
}


@dataclass(frozen=True)
class Scenario:
    unit_rps: float = 2.5  # x: the trace runs 2x, 8x, then 2x
    phases_s: tuple[float, float, float] = (15.0, 40.0, 15.0)
    prompt_len: int = 512
    output_len: int = 24
    ttft_ms: float = 6000.0
    tpot_ms: float = 120.0
    min_workers: int = 2  # each pool
    max_workers: int = 12  # each pool
    seed: int = 0

    def trace(self) -> Trace:
        rates = (2 * self.unit_rps, 8 * self.unit_rps, 2 * self.unit_rps)
        return Trace.steps(
            list(zip(rates, self.phases_s, strict=True)),
            self.prompt_len,
            self.output_len,
            self.seed,
        )

    def config(self, profile_path: Path) -> ServeConfig:
        n = self.min_workers
        return ServeConfig(
            engine={"simulate": str(profile_path), "kv_cache_memory_mb": 64},
            pools={
                "prefill": n,
                "decode": n,
                "prefill_resources": {"num_cpus": 0.1},
                "decode_resources": {"num_cpus": 0.1},
                "cpu_binding": False,
            },
            transfer={"lease_s": 120},
            autoscale={
                "enabled": True,
                "ttft_ms": self.ttft_ms,
                "tpot_ms": self.tpot_ms,
                "profile": str(profile_path),
                "min_prefill": n,
                "min_decode": n,
                "max_prefill": self.max_workers,
                "max_decode": self.max_workers,
                "interval_s": 1.0,
                "window_s": 8.0,
                "scale_down_delay_s": 6.0,
            },
        )


AGAIN = 20  # requests replayed again after the load, at the minimum (same outputs)


@dataclass
class Fixed:
    """The fixed-split replay (bench/autoscale.py) and the planner's baseline."""

    replay: Replay
    split: tuple[int, int]  # the planner's best of the autoscaled run's mean worker count
    cheapest: tuple[int, int]  # the planner's cheapest split meeting the targets
    cheapest_attainment: float  # the planner's


@dataclass
class Outcome:
    autoscaled: Replay
    again: Replay  # the first AGAIN requests, replayed once the pools were at their minimum
    at_minimum_after_s: float | None  # how long after the load the pools were at their minimum
    decisions: int
    peak_target: int  # the most workers the autoscaler asked for at once
    leaks: dict[str, int]
    fixed: Fixed | None = None

    def figures(self, s: Scenario) -> dict[str, float]:
        ttft, tpot = s.ttft_ms / 1e3, s.tpot_ms / 1e3
        out = {
            "autoscaled_attainment": self.autoscaled.attainment(ttft, tpot),
            "autoscaled_mean_workers": self.autoscaled.mean_workers,
            "autoscaled_peak_workers": max(p + d for _, p, d in self.autoscaled.sizes),
            "autoscaled_peak_target": self.peak_target,
            "autoscaled_failed": len(self.autoscaled.errors),
            "requests": len(self.autoscaled.ttft_s),
            "decisions": self.decisions,
        }
        f = self.fixed
        if f is None:
            return out
        span = self.autoscaled.sizes[-1][0] - self.autoscaled.sizes[0][0]
        return out | {
            "fixed_attainment": f.replay.attainment(ttft, tpot),
            "worker_seconds_ratio": self.autoscaled.worker_seconds / (sum(f.cheapest) * span),
            "fixed_workers": sum(f.split),
            "cheapest_fixed_workers": sum(f.cheapest),
            "cheapest_fixed_planner_attainment": f.cheapest_attainment,
            "fixed_failed": len(f.replay.errors),
        }


def _sizes(d: Deployment):
    members = d.backend.members
    return lambda: (members.count("prefill"), members.count("decode"))


def run(s: Scenario, workdir: Path, fixed: bool = True) -> Outcome:
    """The autoscaled replay, then ``AGAIN`` of its requests once the pools are
    at their minimum, and with ``fixed`` the fixed-split replay and the
    planner's baseline, on one deployment (Ray must be up)."""
    path = workdir / "autoscale-profile.json"
    path.write_text(json.dumps(PROFILE))
    profile = Profile.load(path)
    trace = s.trace()
    config = s.config(path)
    d = Deployment(config)
    try:
        runner = AutoscaleRunner(
            d.backend,
            d.server.metrics,
            lifecycle_arrivals(d.server.lifecycle),
            model_for(str(path), config),
        )
        loop_task = asyncio.run_coroutine_threadsafe(runner.run(), d.loop)
        autoscaled = replay(d.address, trace, _sizes(d))
        at_min = _wait_minimum(d, s, timeout_s=s.phases_s[-1] + 30)
        loop_task.cancel()
        head = Trace(trace.arrivals[:AGAIN], trace.prompt_len, trace.output_len, trace.seed)
        again = replay(d.address, head, _sizes(d))
        baseline = _fixed(d, s, profile, config, trace, autoscaled) if fixed else None
        leaks = d.wait_no_leaks()
    finally:
        d.stop()
    decisions = sum(len(o.decisions) for o in runner.outcomes)
    peak_target = max((sum(o.target.values()) for o in runner.outcomes), default=0)
    return Outcome(autoscaled, again, at_min, decisions, peak_target, leaks, baseline)


def _fixed(
    d: Deployment,
    s: Scenario,
    profile: Profile,
    config: ServeConfig,
    trace: Trace,
    autoscaled: Replay,
) -> Fixed:
    """The planner's best split of the autoscaled run's mean worker count,
    replayed; and the planner's cheapest split meeting the targets."""
    ttft, tpot = s.ttft_ms / 1e3, s.tpot_ms / 1e3
    system = system_for(config, profile.kv_bytes_per_token, simulated=True)
    cheapest = cheapest_fixed(profile, system, trace, ttft, tpot, max_workers=2 * s.max_workers)
    mean = max(2, round(autoscaled.mean_workers))
    p, dd, _ = best_split(profile, system, trace, mean, ttft, tpot)
    d.run(d.backend.scale(p, dd, 30.0), timeout=300)
    return Fixed(replay(d.address, trace, _sizes(d)), (p, dd), cheapest[:2], cheapest[2])


def _wait_minimum(d: Deployment, s: Scenario, timeout_s: float) -> float | None:
    start = time.monotonic()
    sizes = _sizes(d)
    while time.monotonic() - start < timeout_s:
        if sizes() == (s.min_workers, s.min_workers):
            return time.monotonic() - start
        time.sleep(0.25)
    return None
