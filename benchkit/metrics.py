"""Latency and throughput figures from per-request records: pure functions.

A record holds what the client saw: when the request was sent, when each
chunk arrived and how many tokens it carried, when the stream ended, the
gRPC status, and the server's final message (usage and timings). All times
are seconds on one monotonic clock (``time.perf_counter`` in the runner).

Definitions (as in vLLM's ``bench serve``):

- TTFT: first chunk carrying a token minus the send time.
- TPOT (per request): ``(last token time - first token time) / (n - 1)``
  for ``n`` output tokens; undefined for ``n < 2``.
- ITL: every gap between consecutive token-carrying chunks, split evenly
  among the later chunk's tokens (a chunk of 3 tokens after a gap of 0.3 s
  gives three ITLs of 0.1 s). Tokens in the first chunk have no ITL.
- E2E: end of the stream minus the send time.
- Goodput: requests that finished OK and meet every SLO; its share is over
  all requests (failed ones count against it), its rate is per second of
  the run.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

OK = "OK"
PERCENTILES = (50, 90, 99)
SLO_KEYS = {"ttft_ms": "ttft", "tpot_ms": "tpot", "e2e_ms": "e2e", "itl_ms": "itl_max"}


@dataclass
class FinalInfo:
    """The parts of the server's final message that the report uses."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # server-side; None when the server does not say (HTTP)
    mean_tpot_s: float | None = None
    prefill_worker: str = ""
    decode_worker: str = ""
    finish_reason: str = ""


@dataclass
class RequestRecord:
    send_time: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens)
    end_time: float | None = None
    status: str = OK  # gRPC status name, or a client-side error name
    final: FinalInfo | None = None
    error: str = ""
    index: int = 0
    conversation: int = 0
    turn: int = 0
    input_len: int = 0  # prompt tokens as sent (0 for text prompts)

    @property
    def ok(self) -> bool:
        return self.status == OK


# ---------------------------------------------------------------- per request


def token_times(rec: RequestRecord) -> list[tuple[float, int]]:
    """Chunks that carried at least one token, in arrival order."""
    return [(t, n) for t, n in rec.chunks if n > 0]


def output_tokens(rec: RequestRecord) -> int:
    return sum(n for _, n in rec.chunks)


def ttft(rec: RequestRecord) -> float | None:
    tt = token_times(rec)
    return tt[0][0] - rec.send_time if tt else None


def tpot(rec: RequestRecord) -> float | None:
    tt = token_times(rec)
    n = sum(k for _, k in tt)
    if n < 2:
        return None
    return (tt[-1][0] - tt[0][0]) / (n - 1)


def itls(rec: RequestRecord) -> list[float]:
    tt = token_times(rec)
    out: list[float] = []
    for (t0, _), (t1, k) in itertools.pairwise(tt):
        out.extend([(t1 - t0) / k] * k)
    return out


def e2e(rec: RequestRecord) -> float | None:
    return None if rec.end_time is None else rec.end_time - rec.send_time


def request_metrics(rec: RequestRecord) -> dict[str, float | None]:
    gaps = itls(rec)
    return {
        "ttft": ttft(rec),
        "tpot": tpot(rec),
        "e2e": e2e(rec),
        "itl_max": max(gaps) if gaps else None,
    }


def meets_slo(rec: RequestRecord, slo: Mapping[str, float]) -> bool:
    """OK and within every limit of ``slo`` ({"ttft_ms": 500, "tpot_ms": 50, ...}).

    A figure that is undefined for the request (TPOT of a one-token answer)
    does not fail it.
    """
    if not rec.ok:
        return False
    m = request_metrics(rec)
    for key, limit_ms in slo.items():
        value = m[SLO_KEYS[key]]
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


# ---------------------------------------------------------------- aggregates


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99, min, max of the defined values (None when empty)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"count": 0, "mean": None, "min": None, "max": None} | {
            f"p{p}": None for p in PERCENTILES
        }
    out: dict[str, float | int | None] = {"count": len(xs), "mean": sum(xs) / len(xs)}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(xs, p)
    out["min"], out["max"] = min(xs), max(xs)
    return out


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First send to last end (or last chunk), in seconds; 0 without records."""
    if not records:
        return 0.0
    start = min(r.send_time for r in records)
    ends = [r.end_time if r.end_time is not None else r.send_time for r in records]
    ends += [t for r in records for t, _ in r.chunks]
    return max(ends) - start


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.status for r in records if not r.ok).items()))


def first_errors(records: Iterable[RequestRecord]) -> dict[str, str]:
    """The first error message (by send time) of each failed status, so that a
    report says why requests failed, not only how many."""
    out: dict[str, str] = {}
    for r in sorted(records, key=lambda r: r.send_time):
        if not r.ok:
            out.setdefault(r.status, r.error)
    return dict(sorted(out.items()))


def parse_slo(text: str | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50"`` -> {"ttft_ms": 500.0, "tpot_ms": 50.0}."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"bad SLO term {part!r}; expected KEY=MS with KEY in {sorted(SLO_KEYS)}"
            )
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO value in {part!r}") from None
        if out[key] <= 0:
            raise ValueError(f"SLO limit must be positive: {part!r}")
    return out


def summarize(
    records: Sequence[RequestRecord],
    slo: Mapping[str, float] | None = None,
    duration_s: float | None = None,
) -> dict:
    """The figures of one run. ``duration_s`` defaults to :func:`run_duration`."""
    duration = run_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.ok]
    out_tokens = sum(output_tokens(r) for r in ok)

    def rate(x: float) -> float | None:
        return x / duration if duration > 0 else None

    finals = [r.final for r in ok if r.final is not None]
    summary: dict = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": error_counts(records),
        "first_errors": first_errors(records),
        "duration_s": duration,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(f.prompt_tokens for f in finals),
        "cached_tokens": sum(f.cached_tokens for f in finals),
        "ttft_s": distribution(ttft(r) for r in ok),
        "tpot_s": distribution(tpot(r) for r in ok),
        "itl_s": distribution(x for r in ok for x in itls(r)),
        "e2e_s": distribution(e2e(r) for r in ok),
        "server_ttft_s": distribution(f.ttft_s for f in finals),
        "server_tpot_s": distribution(f.mean_tpot_s for f in finals if f.completion_tokens > 1),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        summary["slo"] = dict(slo)
        summary["goodput"] = {
            "good": good,
            "share": good / len(records) if records else None,
            "rate": rate(good),
        }
    return summary
