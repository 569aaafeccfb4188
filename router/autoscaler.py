"""The autoscaler's decisions: pool sizes for the observed load and the
latency targets (docs/autoscaling.md).

Each decision (``Policy.decide``, no I/O, the clock given):

1. Corrects the model: at the current sizes, the measured latency over the
   predicted one, smoothed (``CORRECTION_ALPHA``), kept within
   ``CORRECTION_BOUNDS``; updated only once the sizes have been stable for a
   window (the measurements are of those sizes), enough requests finished,
   and no queue builds (at most one prompt per prefill worker waits: the
   requests measured are not those the prediction queues).
2. The fewest prefill workers whose corrected TTFT (queueing included) is at
   most ``headroom`` x the target, then, with them, the fewest decode
   workers whose corrected TPOT is, each within its bounds.
3. A pool grows at once; it shrinks only once a smaller size has sufficed
   for ``scale_down_delay_s``, to the largest size needed over that time.
   The same holds for a growth still under way: its target (the last one
   decided, above the current size while workers start) is lowered only
   after the delay, so that a need that dips while the new workers start
   does not cut the growth short.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from router.autoscaler_model import LatencyModel, Prediction
from router.autoscaler_observe import Load, Observed

CORRECTION_ALPHA = 0.3
CORRECTION_BOUNDS = (0.5, 4.0)
MIN_CORRECTION_SAMPLES = 20
POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Targets:
    """What the autoscaler aims for (from the config's autoscale section)."""

    ttft_s: float
    tpot_s: float
    quantile: float = 0.95
    headroom: float = 0.85
    bounds: dict[str, tuple[int, int]] = field(
        default_factory=lambda: {"prefill": (1, 8), "decode": (1, 8)}
    )
    scale_down_delay_s: float = 20.0
    window_s: float = 20.0


@dataclass(frozen=True)
class Decision:
    """One pool's new size and why."""

    pool: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down"


@dataclass(frozen=True)
class Outcome:
    """One decision round: the sizes wanted, the changes, and the figures behind them."""

    target: dict[str, int]
    decisions: list[Decision]
    predicted: Prediction  # at the current sizes, corrected
    observed: Observed
    correction: dict[str, float]  # ttft, tpot


class Policy:
    def __init__(self, targets: Targets, model: LatencyModel) -> None:
        self.targets = targets
        self.model = model
        self.correction = {"ttft": 1.0, "tpot": 1.0}
        self._sizes: dict[str, int] | None = None
        self._stable_since = 0.0
        self._low_since: dict[str, float] = {}
        self._peak_needed: dict[str, int] = {}
        self._target: dict[str, int] = {}  # the last target decided per pool

    def decide(self, now: float, load: Load, observed: Observed, sizes: dict[str, int]) -> Outcome:
        if sizes != self._sizes:
            self._sizes, self._stable_since = dict(sizes), now
        t = self.targets
        raw = self.model.predict(load, sizes["prefill"], sizes["decode"], t.quantile)
        steady = load.backlog <= sizes["prefill"]  # no queue building: measured ~ predicted
        stable = now - self._stable_since >= t.window_s
        if stable and steady and observed.samples >= MIN_CORRECTION_SAMPLES:
            self._correct("ttft", observed.ttft_s, raw.ttft_s)
            self._correct("tpot", observed.tpot_s, raw.tpot_s)
        needed, why = self._needed(load, sizes)
        decisions = []
        target = {}
        for pool in POOLS:
            target[pool], reason = self._settle(now, pool, sizes[pool], needed[pool], why[pool])
            self._target[pool] = target[pool]
            if target[pool] != sizes[pool]:
                decisions.append(Decision(pool, sizes[pool], target[pool], reason))
        predicted = Prediction(
            raw.ttft_s * self.correction["ttft"], raw.tpot_s * self.correction["tpot"]
        )
        return Outcome(target, decisions, predicted, observed, dict(self.correction))

    def _correct(self, kind: str, measured: float | None, predicted: float) -> None:
        if measured is None or predicted <= 0:
            return
        lo, hi = CORRECTION_BOUNDS
        ratio = min(hi, max(lo, measured / predicted))
        self.correction[kind] += CORRECTION_ALPHA * (ratio - self.correction[kind])

    def _needed(self, load: Load, sizes: dict[str, int]) -> tuple[dict[str, int], dict[str, str]]:
        """The fewest workers per pool that meet the targets, and why that many."""
        t = self.targets
        budget = {
            "ttft": t.headroom * t.ttft_s / self.correction["ttft"],
            "tpot": t.headroom * t.tpot_s / self.correction["tpot"],
        }

        def ttft(p: int) -> float:
            return self.model.predict(load, p, sizes["decode"], t.quantile).ttft_s

        prefill, p_why = _fewest("prefill", t.bounds["prefill"], ttft, "ttft", budget["ttft"])

        def tpot(d: int) -> float:
            return self.model.predict(load, prefill, d, t.quantile).tpot_s

        decode, d_why = _fewest("decode", t.bounds["decode"], tpot, "tpot", budget["tpot"])
        return {"prefill": prefill, "decode": decode}, {"prefill": p_why, "decode": d_why}

    def _settle(
        self, now: float, pool: str, current: int, needed: int, why: str
    ) -> tuple[int, str]:
        """Up at once; down after the delay, to the most needed meanwhile.
        Down is from the larger of ``current`` and the last target (a growth
        under way keeps its target through the delay)."""
        kept = max(current, self._target.get(pool, current))
        if needed >= kept:
            self._low_since.pop(pool, None)
            self._peak_needed.pop(pool, None)
            return needed, why
        since = self._low_since.setdefault(pool, now)
        peak = self._peak_needed[pool] = max(self._peak_needed.get(pool, needed), needed)
        held = now - since
        if held < self.targets.scale_down_delay_s:
            return kept, why
        self._low_since.pop(pool, None)
        self._peak_needed.pop(pool, None)
        return peak, f"{why}; {peak} sufficed for {held:.0f} s"


def _fewest(
    pool: str, bounds: tuple[int, int], latency: Callable[[int], float], kind: str, budget: float
) -> tuple[int, str]:
    """The smallest size in ``bounds`` whose ``latency`` is within ``budget``
    (latency falls as the size grows: a binary search), and why."""
    lo, hi = bounds
    if latency(hi) > budget:
        return hi, f"{kind} over budget even at the most {pool} workers ({hi})"
    while lo < hi:
        mid = (lo + hi) // 2
        if latency(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    value = latency(lo)
    return lo, f"{kind} {value * 1e3:.0f} ms predicted <= budget {budget * 1e3:.0f} ms"
