"""The latency model the autoscaler sizes pools with: the planner's
simulator (planner/simulator.py, pure python and numpy) run on the load the
router observes.

``LatencyModel`` is the one interface the decision logic uses
(router/autoscaler.py); ``PlannerModel`` implements it with the planner, so a
new planner API is one change here. A prediction replays the queue the
pools have now (``Load.backlog``, arriving at once) and then the observed
rate for ``horizon_s``: the TTFT it predicts counts the time those requests
queue, so a growing queue asks for more prefill workers before it is long.
The requests decoding now (``Load.decoding``, half their output left on
average) start in the decode steps: a pool that a drained queue filled has
slower steps, and needs more workers, than one fed at the arrival rate.
Every prompt starts with the same prefix, the observed hit rate's share of
the mean prompt (the planner's model routes and caches it), the rest its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from planner.profile import Profile
from planner.profiles import load_profile
from planner.settings import system_for
from planner.simulator import SystemConfig, simulate
from planner.trace import Trace, TraceRequest
from router.autoscaler_observe import Load

if TYPE_CHECKING:
    from router.config import ServeConfig

MIN_REQUESTS = 60  # a prediction simulates at least this many requests
MAX_REQUESTS = 300  # and at most this many (a prediction takes tens of ms)


@dataclass(frozen=True)
class Prediction:
    """Latencies at one quantile for one pool size."""

    ttft_s: float
    tpot_s: float


class LatencyModel(Protocol):
    def predict(self, load: Load, prefill: int, decode: int, quantile: float) -> Prediction:
        """TTFT and TPOT at ``quantile`` with ``prefill`` and ``decode`` workers."""
        ...


class PlannerModel:
    """``LatencyModel`` by the planner's discrete-event simulation of a profile."""

    def __init__(
        self,
        profile: Profile,
        system: SystemConfig | None = None,
        horizon_s: float = 15.0,
        seed: int = 0,
    ) -> None:
        self.profile = profile
        self.system = system or SystemConfig(1, 1, kv_bytes_per_token=profile.kv_bytes_per_token)
        self.horizon_s = horizon_s
        self.seed = seed

    def predict(self, load: Load, prefill: int, decode: int, quantile: float) -> Prediction:
        trace = self._trace(load)
        if not trace.requests:
            return Prediction(0.0, 0.0)
        result = simulate(
            trace,
            replace(self.system, num_prefill=prefill, num_decode=decode),
            self.profile.prefill_s,
            self.profile.decode_step_s,
            step_cost=self.profile.step_s,
            resident=self._resident(load),
        )
        q = quantile * 100
        tpot = result.tpot[result.tpot > 0]
        return Prediction(
            float(np.percentile(result.ttft, q)) if result.ttft.size else 0.0,
            float(np.percentile(tpot, q)) if tpot.size else 0.0,
        )

    def _trace(self, load: Load) -> Trace:
        """The backlog at t=0, then Poisson arrivals at the load's rate (fixed
        lengths: the load's means; the same seed for every size compared)."""
        prompt = max(1, round(load.prompt_tokens))
        output = max(1, round(load.output_tokens))
        block = self.system.block_size
        shared = int(load.hit_rate * prompt) // block * block
        arrivals = min(MAX_REQUESTS, max(MIN_REQUESTS, round(load.rate_rps * self.horizon_s)))
        if load.rate_rps <= 0:
            arrivals = 0
        rng = random.Random(self.seed)
        times = [0.0] * min(load.backlog, MAX_REQUESTS)
        t = 0.0
        for _ in range(arrivals):
            t += rng.expovariate(load.rate_rps)
            times.append(t)
        head = (1,) * shared
        requests = (
            TraceRequest(at, head + (i + 2,) * (prompt - shared), output)
            for i, at in enumerate(times)
        )
        return Trace("autoscale", tuple(requests))

    def _resident(self, load: Load) -> list[TraceRequest]:
        """The requests decoding now, each with half the mean output left."""
        prompt = max(1, round(load.prompt_tokens))
        left = max(1, round(load.output_tokens / 2))
        count = min(load.decoding, MAX_REQUESTS)
        return [TraceRequest(0.0, (-2 - i,) * prompt, left) for i in range(count)]


def model_for(profile: str | None, config: ServeConfig) -> PlannerModel:
    """The planner's model of ``profile`` (a shipped profile's name or a profile
    file, ``tandem plan --profile-out``) on ``config``'s deployment: its token
    budgets, batch and block sizes, KV pools and routing rules, as ``tandem
    plan`` builds them (planner/settings.py ``system_for``)."""
    if profile is None:
        raise ValueError(
            "autoscale.profile: give a profile (a file or a shipped name) unless the "
            "engine is simulated (engine.simulate)"
        )
    loaded = load_profile(profile)
    simulated = config.engine.simulate is not None
    system = system_for(config, loaded.kv_bytes_per_token, simulated=simulated)
    return PlannerModel(loaded, system)
