"""The planner's API for callers at run time (the router's autoscaler).

Torch-free: numpy and the standard library only.

    from planner.predict import SLO, cheapest_split, predict
    from planner.trace import WorkloadStats

    stats = WorkloadStats(rate=12.0, prompt_lens=(64, 512), output_lens=(32, 128),
                          mean_prompt_len=288, mean_output_len=80, prefix_share=0.1)
    p = predict(profile, stats, prefill_workers=2, decode_workers=2)
    p.ttft_p50, p.ttft_p90, p.tpot_p50, p.tpot_p90  # seconds
    split = cheapest_split(profile, stats, SLO(ttft_s=0.5, tpot_s=0.05),
                           max_workers=16, min_prefill=1, min_decode=1)
    split.prefill_workers, split.decode_workers, split.prediction  # or None

``profile`` is anything with ``prefill_s(lengths)`` and
``decode_step_s(batch, ctx)`` (planner.profile.Profile), and where it has
one, ``step_s(lengths, contexts, decode_batch, decode_ctx)`` for a whole
engine step (chunks after cached tokens, mixed steps). ``system``
(planner.simulator.SystemConfig) carries the serving settings (token
budgets, block size, KV pool sizes, transfer bandwidth and latency); its
pool sizes are replaced by the arguments. ``predict_trace`` runs an exact
trace instead of statistics. The model is planner.simulator's; how it
counts queueing, the KV push, prefix hits and KV capacity is in its
docstring and docs/planning.md.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from planner.simulator import SimResult, SystemConfig, simulate
from planner.trace import Trace, TraceRequest, WorkloadStats


class CostProfile(Protocol):
    def prefill_s(self, lengths: Sequence[int]) -> float: ...

    def decode_step_s(self, batch: int, ctx: float) -> float: ...


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # share of requests meeting both


@dataclass(frozen=True)
class Prediction:
    ttft_p50: float  # seconds
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    attainment: float  # of the SLO given, 1.0 when none
    mean_admission_wait_s: float  # waiting for KV room on a decode worker
    mean_queue_wait_s: float  # arrival to the start of the prefill
    prefix_hit_share: float  # prompt tokens served from a cache
    failed: int  # requests no decode worker's pool can hold

    @classmethod
    def of(cls, res: SimResult) -> Prediction:
        done = [r for r in res.requests if not r.failed]

        def q(a: np.ndarray, p: float) -> float:
            return float(np.percentile(a, p)) if len(a) else float("nan")

        return cls(
            ttft_p50=q(res.ttft, 50),
            ttft_p90=q(res.ttft, 90),
            tpot_p50=q(res.tpot, 50),
            tpot_p90=q(res.tpot, 90),
            attainment=res.attainment,
            mean_admission_wait_s=float(np.mean([r.admitted - r.arrival for r in done]))
            if done
            else 0.0,
            mean_queue_wait_s=res.mean_queue_wait if done else 0.0,
            prefix_hit_share=res.prefix_hit_share,
            failed=res.failed,
        )


@dataclass(frozen=True)
class Split:
    prefill_workers: int
    decode_workers: int
    prediction: Prediction

    @property
    def total(self) -> int:
        return self.prefill_workers + self.decode_workers


def synthetic_trace(
    stats: WorkloadStats, num_requests: int = 400, seed: int = 0, block_size: int = 16
) -> Trace:
    """A Poisson trace with the statistics' rate and lengths (uniform between
    the p10 and p90); a prefix of ``prefix_share`` of the mean prompt is
    shared by every prompt (a system prompt), in whole blocks."""
    rng = random.Random(seed)
    shared_len = int(stats.prefix_share * stats.mean_prompt_len) // block_size * block_size
    shared = tuple(rng.randrange(1, 1 << 30) for _ in range(shared_len))
    t, reqs = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(stats.rate)
        n = max(shared_len + 1, rng.randint(*stats.prompt_lens))
        tail = tuple(rng.randrange(1, 1 << 30) for _ in range(n - shared_len))
        reqs.append(TraceRequest(t, shared + tail, max(1, rng.randint(*stats.output_lens))))
    return Trace("synthetic", tuple(reqs))


def predict_trace(
    profile: CostProfile,
    trace: Trace,
    prefill_workers: int,
    decode_workers: int,
    system: SystemConfig | None = None,
    slo: SLO | None = None,
) -> Prediction:
    base = system or SystemConfig(1, 1)
    res = simulate(
        trace,
        replace(base, num_prefill=prefill_workers, num_decode=decode_workers),
        profile.prefill_s,
        profile.decode_step_s,
        ttft_slo_s=slo.ttft_s if slo else float("inf"),
        tpot_slo_s=slo.tpot_s if slo else float("inf"),
        # A CostProfile needs only the two methods (tests' fakes have no more);
        # a Profile's own mixed-step rule when it has one.
        step_cost=getattr(profile, "step_s", None),
    )
    return Prediction.of(res)


def predict(
    profile: CostProfile,
    workload_stats: WorkloadStats,
    prefill_workers: int,
    decode_workers: int,
    system: SystemConfig | None = None,
    slo: SLO | None = None,
    *,
    num_requests: int = 400,
    seed: int = 0,
) -> Prediction:
    """TTFT and TPOT percentiles of the pools under the load the statistics
    describe (a synthetic trace of ``num_requests``, seeded)."""
    block = (system or SystemConfig(1, 1)).block_size
    trace = synthetic_trace(workload_stats, num_requests, seed, block)
    return predict_trace(profile, trace, prefill_workers, decode_workers, system, slo)


def cheapest_split(
    profile: CostProfile,
    workload: WorkloadStats | Trace,
    slo: SLO,
    *,
    max_workers: int,
    min_prefill: int = 1,
    min_decode: int = 1,
    system: SystemConfig | None = None,
    num_requests: int = 400,
    seed: int = 0,
) -> Split | None:
    """The fewest workers in all whose predicted attainment reaches the
    SLO's; among splits of that total, the highest attainment (ties: fewer
    prefill workers). None when no split up to ``max_workers`` does."""
    block = (system or SystemConfig(1, 1)).block_size
    trace = (
        workload
        if isinstance(workload, Trace)
        else synthetic_trace(workload, num_requests, seed, block)
    )
    for total in range(min_prefill + min_decode, max_workers + 1):
        ok = []
        for p in range(min_prefill, total - min_decode + 1):
            pred = predict_trace(profile, trace, p, total - p, system, slo)
            if pred.attainment >= slo.attainment:
                ok.append(Split(p, total - p, pred))
        if ok:
            return max(ok, key=lambda s: (s.prediction.attainment, -s.prefill_workers))
    return None
