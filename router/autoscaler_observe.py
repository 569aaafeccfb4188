"""What the autoscaler sees of the load: requests as they finish (their
lengths, prefix hits and latencies, from the router's metrics), and the
queues now.

The arrival rate comes from the router's count of requests that arrived
(finished, whatever their status, plus in flight), sampled every round.
The rate reported is the higher of the whole window's and its last
quarter's, so a step up is seen within a quarter window, and a step down
only once the whole window has passed. A finished request's arrival (its
finish less its end-to-end time) places it in the window for the lengths
and latencies.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.backend import GenerateResult

RECENT_SHARE = 0.25  # the short window: this share of the window, at its end


@dataclass(frozen=True)
class Finished:
    """One finished request, as the autoscaler keeps it."""

    arrival: float  # the observer's clock
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    tpot_s: float | None  # None: one output token or none


@dataclass(frozen=True)
class Load:
    """One router's load over its window, and its queues now."""

    rate_rps: float
    prompt_tokens: float  # mean per request
    output_tokens: float  # mean per request
    hit_rate: float  # cached prompt tokens / prompt tokens
    backlog: int  # prompts queued or computing on the prefill workers now
    samples: int = 0  # finished requests the means are taken over
    decoding: int = 0  # requests on the decode workers now

    @staticmethod
    def combined(loads: Sequence[Load]) -> Load:
        """Several routers' loads as one: rates add, means weigh by samples; the
        backlog and the requests decoding are the largest (every router counts
        the same workers)."""
        if not loads:
            return IDLE
        weights = [max(load.samples, 1) for load in loads]

        def mean(values: Sequence[float]) -> float:
            return float(np.average(values, weights=weights))

        return Load(
            rate_rps=sum(load.rate_rps for load in loads),
            prompt_tokens=mean([load.prompt_tokens for load in loads]),
            output_tokens=mean([load.output_tokens for load in loads]),
            hit_rate=mean([load.hit_rate for load in loads]),
            backlog=max(load.backlog for load in loads),
            samples=sum(load.samples for load in loads),
            decoding=max(load.decoding for load in loads),
        )


IDLE = Load(rate_rps=0.0, prompt_tokens=1.0, output_tokens=1.0, hit_rate=0.0, backlog=0)


@dataclass(frozen=True)
class Observed:
    """Measured latencies over the window at the autoscaler's quantile."""

    ttft_s: float | None  # None: no finished request in the window
    tpot_s: float | None
    samples: int


class Observer:
    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.finished: deque[Finished] = deque()
        self.arrived: deque[tuple[float, int]] = deque()  # (time, requests arrived so far)
        self.last: Load = IDLE  # the lengths of the last window that had any

    def record(self, result: GenerateResult, e2e_s: float) -> None:
        """A request finished (``RouterMetrics`` calls it with every result)."""
        if result.finish_reason == "abort" or not result.completion_tokens:
            return
        tpot = result.mean_tpot_s if result.completion_tokens > 1 else None
        self.finished.append(
            Finished(
                self.clock() - e2e_s,
                result.prompt_tokens,
                result.cached_tokens,
                result.completion_tokens,
                result.ttft_s,
                tpot,
            )
        )

    def _window(self, now: float) -> list[Finished]:
        horizon = now - 2 * self.window_s  # arrivals older than the window may finish late
        while self.finished and self.finished[0].arrival < horizon:
            self.finished.popleft()
        return [f for f in self.finished if f.arrival >= now - self.window_s]

    def _rate(self, now: float, arrived: int) -> float:
        self.arrived.append((now, arrived))
        while self.arrived and self.arrived[0][0] < now - self.window_s:
            self.arrived.popleft()
        recent_s = self.window_s * RECENT_SHARE
        rates = []
        for span_s in (self.window_s, recent_s):
            first = next((a for a in self.arrived if a[0] >= now - span_s), self.arrived[-1])
            elapsed = now - first[0]
            if elapsed > 0:
                rates.append((arrived - first[1]) / elapsed)
        return max(rates, default=0.0)

    def load(self, arrived: int, backlog: int, decoding: int = 0) -> Load:
        """The load over the window; ``arrived``: requests that reached the
        router so far (a count that only grows), ``backlog``: prompts on the
        prefill workers now, ``decoding``: requests on the decode workers now."""
        now = self.clock()
        window = self._window(now)
        rate = self._rate(now, arrived)
        if not window:  # nothing finished lately: the lengths seen last
            last = self.last
            return Load(
                rate, last.prompt_tokens, last.output_tokens, last.hit_rate, backlog, 0, decoding
            )
        prompt = sum(f.prompt_tokens for f in window)
        cached = sum(f.cached_tokens for f in window)
        self.last = Load(
            rate_rps=rate,
            prompt_tokens=prompt / len(window),
            output_tokens=sum(f.output_tokens for f in window) / len(window),
            hit_rate=cached / prompt if prompt else 0.0,
            backlog=backlog,
            samples=len(window),
            decoding=decoding,
        )
        return self.last

    def observed(self, quantile: float, since: float | None = None) -> Observed:
        """Latencies of the requests that arrived in the window (and after ``since``)."""
        now = self.clock()
        window = [f for f in self._window(now) if since is None or f.arrival >= since]
        ttfts = [f.ttft_s for f in window]
        tpots = [f.tpot_s for f in window if f.tpot_s is not None]
        q = quantile * 100
        return Observed(
            float(np.percentile(ttfts, q)) if ttfts else None,
            float(np.percentile(tpots, q)) if tpots else None,
            len(window),
        )
