"""SLO attainment per window of a run: pure functions over request records.

A request belongs to the window its send time falls in (seconds since the
run's start). Attainment is the share of the window's requests that
finished OK and met every SLO term (``metrics.meets_slo``; failed requests
count against it); a window that sent nothing has none (None).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchkit.metrics import RequestRecord, meets_slo, percentile, tpot, ttft
from benchkit.schedule import RateSchedule


@dataclass(frozen=True)
class WindowStats:
    start_s: float
    end_s: float
    offered_rate: float | None  # the schedule's mean rate over the window (None: no schedule)
    sent: int
    completed: int  # finished OK
    failed: int
    good: int  # OK and within every SLO term
    attainment: float | None  # good / sent; None when nothing was sent
    ttft_p50_s: float | None  # of the OK requests
    ttft_p90_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None


def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def window_stats(
    records: Sequence[RequestRecord],
    start: float,
    window_s: float,
    duration_s: float,
    slo: Mapping[str, float],
    schedule: RateSchedule | None = None,
) -> list[WindowStats]:
    """One :class:`WindowStats` per ``window_s`` from ``start`` (the run's
    clock) to ``duration_s`` (the last window may be shorter). A request
    sent at or after ``duration_s`` counts in the last window."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    n = max(1, math.ceil(duration_s / window_s - 1e-9))
    buckets: list[list[RequestRecord]] = [[] for _ in range(n)]
    for r in records:
        k = min(max(int((r.send_time - start) // window_s), 0), n - 1)
        buckets[k].append(r)
    out = []
    for k, recs in enumerate(buckets):
        t0, t1 = k * window_s, min((k + 1) * window_s, duration_s)
        ok = [r for r in recs if r.ok]
        good = sum(meets_slo(r, slo) for r in recs)
        ttfts = [x for x in (ttft(r) for r in ok) if x is not None]
        tpots = [x for x in (tpot(r) for r in ok) if x is not None]
        offered = schedule.expected(t0, t1) / (t1 - t0) if schedule and t1 > t0 else None
        out.append(
            WindowStats(
                start_s=t0,
                end_s=t1,
                offered_rate=offered,
                sent=len(recs),
                completed=len(ok),
                failed=len(recs) - len(ok),
                good=good,
                attainment=good / len(recs) if recs else None,
                ttft_p50_s=_pct(ttfts, 50),
                ttft_p90_s=_pct(ttfts, 90),
                tpot_p50_s=_pct(tpots, 50),
                tpot_p90_s=_pct(tpots, 90),
            )
        )
    return out


def worst_attainment(windows: Sequence[WindowStats]) -> float | None:
    """The lowest attainment of a window that sent something."""
    values = [w.attainment for w in windows if w.attainment is not None]
    return min(values) if values else None
