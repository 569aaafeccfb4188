"""Load that changes over time: a rate schedule and its arrival times.

A :class:`RateSchedule` is a piecewise-constant rate (requests/s) over
``[0, duration_s)``. It is built from

- steps, ``"0:2,60:8,120:2"``: 2 req/s from 0 s, 8 from 60 s, 2 from 120 s;
- a daily shape, ``"daily:LOW:PEAK"``: a day's traffic compressed into the
  run, lowest at 04:00 and highest at 16:00 (a raised cosine), held
  constant over each of 96 pieces (a quarter of an hour of the day each);

with bursts on top (``"AT:LEN:FACTOR"``: the rate times FACTOR over
``[AT, AT+LEN)``).

Arrivals are drawn by time rescaling: gaps of mean 1 (gamma of shape
``burstiness``, the same stream as a constant rate's) in "expected
requests" space, mapped back through the schedule's cumulative rate. So a
schedule of one constant rate gives exactly the arrivals of that rate, and
the expected number of arrivals in any window is the integral of the rate
over it (:meth:`RateSchedule.expected`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

DAILY_PIECES = 96
"""Pieces of a daily shape (one per quarter hour of the day)."""
TROUGH_HOUR, PEAK_HOUR = 4.0, 16.0


@dataclass(frozen=True)
class Segment:
    start_s: float
    rate: float  # requests/s from start_s until the next segment (or the end)


@dataclass(frozen=True)
class Burst:
    at_s: float
    length_s: float
    factor: float  # the rate is multiplied by this over [at_s, at_s + length_s)


@dataclass(frozen=True)
class RateSchedule:
    segments: tuple[Segment, ...]  # sorted by start, the first at 0
    duration_s: float

    def __post_init__(self) -> None:
        if not self.segments or self.segments[0].start_s != 0:
            raise ValueError("a schedule starts at 0 s")
        starts = [s.start_s for s in self.segments]
        if starts != sorted(set(starts)) or starts[-1] >= self.duration_s:
            raise ValueError("segment starts must increase and lie before the end")
        if any(not (s.rate >= 0 and math.isfinite(s.rate)) for s in self.segments):
            raise ValueError("rates must be finite and >= 0")

    def _ends(self) -> list[float]:
        return [s.start_s for s in self.segments[1:]] + [self.duration_s]

    def rate_at(self, t: float) -> float:
        """The rate at ``t`` s (0 outside ``[0, duration_s)``)."""
        if not 0 <= t < self.duration_s:
            return 0.0
        i = bisect.bisect_right([s.start_s for s in self.segments], t) - 1
        return self.segments[i].rate

    def expected(self, t0: float, t1: float) -> float:
        """Expected arrivals in ``[t0, t1)``: the integral of the rate."""
        total = 0.0
        for seg, end in zip(self.segments, self._ends(), strict=True):
            lo, hi = max(t0, seg.start_s), min(t1, end)
            if hi > lo:
                total += seg.rate * (hi - lo)
        return total

    def _time_of(self, u: float) -> float | None:
        """The time at which ``u`` requests are expected; None past the end."""
        for seg, end in zip(self.segments, self._ends(), strict=True):
            here = seg.rate * (end - seg.start_s)
            if u < here:
                return seg.start_s + u / seg.rate
            u -= here
        return None

    def arrivals(self, seed: int = 0, burstiness: float = 1.0) -> list[float]:
        """Arrival offsets (s, ascending, within the run); the first at 0
        when the rate at 0 is positive."""
        if burstiness <= 0:
            raise ValueError("burstiness must be positive")
        rng = np.random.default_rng([seed, 1])
        out: list[float] = []
        u = 0.0
        while True:
            t = self._time_of(u)
            if t is None:
                return out
            out.append(t)
            u += float(rng.gamma(burstiness, 1.0 / burstiness))

    def with_bursts(self, bursts: list[Burst]) -> RateSchedule:
        """This schedule with each burst's factor applied over its span."""
        cuts = {s.start_s for s in self.segments}
        for b in bursts:
            cuts |= {min(b.at_s, self.duration_s), min(b.at_s + b.length_s, self.duration_s)}
        segments = []
        for t in sorted(c for c in cuts if c < self.duration_s):
            rate = self.rate_at(t)
            for b in bursts:
                if b.at_s <= t < b.at_s + b.length_s:
                    rate *= b.factor
            if not segments or segments[-1].rate != rate:
                segments.append(Segment(t, rate))
        return RateSchedule(tuple(segments), self.duration_s)

    def peak(self) -> float:
        return max(s.rate for s in self.segments)


def daily_shape(low: float, peak: float, duration_s: float) -> RateSchedule:
    """A day's traffic in ``duration_s``: ``low`` at 04:00, ``peak`` at 16:00."""
    if not 0 <= low <= peak:
        raise ValueError(f"expected 0 <= LOW <= PEAK, got {low}, {peak}")
    piece = duration_s / DAILY_PIECES
    segments = []
    for i in range(DAILY_PIECES):
        hour = 24.0 * (i + 0.5) / DAILY_PIECES  # the piece's middle
        phase = 2 * math.pi * (hour - TROUGH_HOUR) / (2 * (PEAK_HOUR - TROUGH_HOUR))
        segments.append(Segment(i * piece, low + (peak - low) * (1 - math.cos(phase)) / 2))
    return RateSchedule(tuple(segments), duration_s)


def _number(text: str, what: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"{what}: expected a number, got {text!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what}: expected a finite number >= 0, got {text!r}")
    return x


def parse_schedule(text: str, duration_s: float | None = None) -> RateSchedule:
    """``"T0:R0,T1:R1,..."`` (steps) or ``"daily:LOW:PEAK"``.

    Steps end at ``duration_s``; without it the last step lasts as long as
    the one before it (60 s for a single step). A daily shape needs
    ``duration_s``.
    """
    text = text.strip()
    if text.startswith("daily:"):
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"expected daily:LOW:PEAK, got {text!r}")
        if duration_s is None:
            raise ValueError("a daily shape needs the run's length (--duration)")
        return daily_shape(_number(parts[1], "LOW"), _number(parts[2], "PEAK"), duration_s)
    steps = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        at, sep, rate = item.partition(":")
        if not sep:
            raise ValueError(f"expected T:RATE, got {item!r}")
        steps.append(Segment(_number(at, "T"), _number(rate, "RATE")))
    if not steps:
        raise ValueError("expected steps T0:R0,T1:R1,... or daily:LOW:PEAK")
    if duration_s is None:
        last = steps[-1].start_s - steps[-2].start_s if len(steps) > 1 else 60.0
        duration_s = steps[-1].start_s + last
    return RateSchedule(tuple(steps), duration_s)


def parse_bursts(text: str) -> list[Burst]:
    """``"AT:LEN:FACTOR,..."``: the rate times FACTOR for LEN s from AT s."""
    bursts = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"expected AT:LEN:FACTOR, got {item!r}")
        names = ("AT", "LEN", "FACTOR")
        at, length, factor = (_number(p, n) for p, n in zip(parts, names, strict=True))
        if length <= 0:
            raise ValueError(f"a burst lasts more than 0 s, got {item!r}")
        bursts.append(Burst(at, length, factor))
    return bursts
