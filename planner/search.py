"""Search (prefill, decode) pool sizes that meet the SLOs with the fewest workers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.simulator import DecodeCost, PrefillCost, SimResult, SystemConfig, Workload, simulate
from planner.trace import Trace
from planner.workers import StepFn


@dataclass(frozen=True)
class Candidate:
    num_prefill: int
    num_decode: int
    attainment: float
    goodput: float
    summary: dict[str, float]

    @property
    def total(self) -> int:
        return self.num_prefill + self.num_decode


@dataclass
class Plan:
    best: Candidate | None  # None: nothing up to max_workers meets the target
    naive: Candidate  # P = total // 2 (at least 1), D = the rest
    evaluated: list[Candidate]
    target: float


def evaluate(
    workload: Workload | Trace,
    system: SystemConfig,
    prefill_cost: PrefillCost,
    decode_cost: DecodeCost,
    ttft_slo_s: float,
    tpot_slo_s: float,
    seed: int,
    step_cost: StepFn | None = None,
) -> Candidate:
    res: SimResult = simulate(
        workload,
        system,
        prefill_cost,
        decode_cost,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        seed=seed,
        step_cost=step_cost,
    )
    return Candidate(
        system.num_prefill, system.num_decode, res.attainment, res.goodput, res.summary()
    )


def naive_split(total: int) -> tuple[int, int]:
    p = max(1, total // 2)
    return p, max(1, total - p)


def search(
    workload: Workload | Trace,
    prefill_cost: PrefillCost,
    decode_cost: DecodeCost,
    *,
    ttft_slo_s: float,
    tpot_slo_s: float,
    target: float = 0.9,
    max_workers: int = 8,
    base: SystemConfig | None = None,
    seed: int = 0,
    step_cost: StepFn | None = None,
) -> Plan:
    """Try every (P, D) with P + D = T for T = 2, 3, ... up to max_workers; the
    first T with a pair at or above the target wins, the pair with the highest
    attainment among those (ties: fewer prefill workers). The naive split is
    for the winning total (or max_workers when nothing wins)."""
    if max_workers < 2:
        raise ValueError("max_workers must be >= 2 (one prefill and one decode worker)")
    base = base or SystemConfig(1, 1)
    cache: dict[tuple[int, int], Candidate] = {}

    def run(p: int, d: int) -> Candidate:
        if (p, d) not in cache:
            system = replace(base, num_prefill=p, num_decode=d)
            cache[p, d] = evaluate(
                workload, system, prefill_cost, decode_cost, ttft_slo_s, tpot_slo_s, seed,
                step_cost,
            )  # fmt: skip
        return cache[p, d]

    best = None
    for total in range(2, max_workers + 1):
        ok = [c for c in (run(p, total - p) for p in range(1, total)) if c.attainment >= target]
        if ok:
            best = max(ok, key=lambda c: (c.attainment, -c.num_prefill))
            break
    naive = run(*naive_split(best.total if best else max_workers))
    evaluated = sorted(cache.values(), key=lambda c: (c.total, c.num_prefill))
    return Plan(best=best, naive=naive, evaluated=evaluated, target=target)
