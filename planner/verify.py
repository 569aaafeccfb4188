"""Replay a trace against a running deployment and set what it measured
beside what the model predicted for the same trace.

The replay sends each request of the trace at its arrival time (from the
replay's start), with the trace's prompt token ids, ``max_tokens`` set to
its output length and EOS ignored, and measures client-side: TTFT from the
send to the first token, TPOT as (last token - first) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import numpy as np

from planner.predict import Prediction
from planner.trace import Trace

METRICS = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")


@dataclass
class Measured:
    ttft_s: list[float]
    tpot_s: list[float]
    errors: int
    index: list[int] = field(default_factory=list)  # trace position of each measurement

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        total = len(self.ttft_s) + self.errors
        if total == 0:
            return 0.0
        good = sum(
            t <= ttft_slo_s and p <= tpot_slo_s
            for t, p in zip(self.ttft_s, self.tpot_s, strict=True)
        )
        return good / total

    def percentiles(self) -> dict[str, float]:
        def q(a: list[float], p: float) -> float:
            return float(np.percentile(a, p)) if a else math.nan

        return {
            "ttft_p50": q(self.ttft_s, 50),
            "ttft_p90": q(self.ttft_s, 90),
            "tpot_p50": q(self.tpot_s, 50),
            "tpot_p90": q(self.tpot_s, 90),
        }


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured, seconds; ``error`` is (predicted -
    measured) / measured, per metric."""

    workload: str
    predicted: dict[str, float]
    measured: dict[str, float]
    errors: int  # requests that failed in the replay

    @property
    def error(self) -> dict[str, float]:
        return {k: (self.predicted[k] - self.measured[k]) / self.measured[k] for k in METRICS}

    def max_error(self, quantile: str) -> float:
        return max(abs(v) for k, v in self.error.items() if k.endswith(quantile))

    def table(self) -> str:
        lines = [f"{self.workload}: {'predicted':>10} {'measured':>10} {'error':>8}"]
        for k in METRICS:
            lines.append(
                f"  {k + ' ms':<12} {self.predicted[k] * 1e3:>10.1f}"
                f" {self.measured[k] * 1e3:>10.1f} {self.error[k]:>+8.1%}"
            )
        if self.errors:
            lines.append(f"  {self.errors} requests failed")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {
            "predicted_ms": {k: round(v * 1e3, 2) for k, v in self.predicted.items()},
            "measured_ms": {k: round(v * 1e3, 2) for k, v in self.measured.items()},
            "error": {k: round(v, 4) for k, v in self.error.items()},
            "failed": self.errors,
        }


def compare(workload: str, prediction: Prediction, measured: Measured) -> Comparison:
    predicted = {k: getattr(prediction, k) for k in METRICS}
    return Comparison(workload, predicted, measured.percentiles(), measured.errors)


async def _one(client, token_ids: list[int], max_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = last = None
    n = 0
    async for r in client.generate(
        token_ids, temperature=0, max_tokens=max_tokens, ignore_eos=True
    ):
        if r.HasField("chunk") and r.chunk.token_ids:
            last = time.perf_counter()
            if first is None:
                first = last
            n += len(r.chunk.token_ids)
    if first is None or last is None:
        raise RuntimeError("no tokens received")
    tpot = (last - first) / (n - 1) if n > 1 else 0.0
    return first - start, tpot


async def replay(target: str, trace: Trace, *, timeout_s: float = 300) -> Measured:
    """Send the trace's requests at their times; measure each (in trace order)."""
    from router.client import TandemClient

    n = len(trace.requests)
    ttft: list[float] = [math.nan] * n
    tpot: list[float] = [math.nan] * n
    failed = 0
    async with TandemClient(target, timeout_s=timeout_s) as client:
        t0 = time.perf_counter()

        async def fire(i: int) -> None:
            nonlocal failed
            r = trace.requests[i]
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            try:
                ttft[i], tpot[i] = await _one(client, list(r.prompt), r.output_len)
            except Exception:
                failed += 1

        await asyncio.gather(*(fire(i) for i in range(n)))
    ok = [i for i in range(n) if not math.isnan(ttft[i])]
    return Measured([ttft[i] for i in ok], [tpot[i] for i in ok], failed, ok)
