"""The JSON report and the human-readable table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from benchkit.metrics import RequestRecord, e2e, output_tokens, tpot, ttft

MAX_ERROR_CHARS = 200
METRIC_ROWS = (
    ("TTFT", "ttft_s"),
    ("TPOT", "tpot_s"),
    ("ITL", "itl_s"),
    ("E2E", "e2e_s"),
    ("server TTFT", "server_ttft_s"),
)


def request_rows(records: Sequence[RequestRecord]) -> list[dict]:
    """Per-request figures for the JSON report, in send order."""
    rows = []
    for r in sorted(records, key=lambda r: r.send_time):
        rows.append(
            {
                "index": r.index,
                "conversation": r.conversation,
                "turn": r.turn,
                "status": r.status,
                "error": r.error or None,
                "input_len": r.input_len or (r.final.prompt_tokens if r.final else None),
                "output_tokens": output_tokens(r),
                "cached_tokens": r.final.cached_tokens if r.final else None,
                "ttft_s": ttft(r),
                "tpot_s": tpot(r),
                "e2e_s": e2e(r),
                "server_ttft_s": r.final.ttft_s if r.final else None,
                "prefill_worker": r.final.prefill_worker if r.final else None,
                "decode_worker": r.final.decode_worker if r.final else None,
            }
        )
    return rows


def _clean(x):
    """NaN and inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def write_json(report: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(report), indent=2) + "\n", encoding="utf-8")
    return path


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_run(run: dict) -> str:
    s = run["summary"]
    lines = [
        f"== {run['label']}: {s['requests']} requests, {s['failed']} failed, "
        f"{s['duration_s']:.1f} s",
        f"{'(ms)':<12}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for name, key in METRIC_ROWS:
        d = s[key]
        lines.append(
            f"{name:<12}" + "".join(f"{_ms(d[k]):>9}" for k in ("mean", "p50", "p90", "p99"))
        )
    lines.append(
        f"throughput  {_num(s['request_throughput'])} req/s, "
        f"{_num(s['output_throughput'], '.1f')} output tok/s"
    )
    if "goodput" in s:
        g = s["goodput"]
        terms = ", ".join(f"{k}<={v:g}" for k, v in s["slo"].items())
        share = "-" if g["share"] is None else f"{g['share'] * 100:.1f}%"
        lines.append(f"goodput     {share} of requests, {_num(g['rate'])} req/s ({terms})")
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    lines.append(f"errors      {errors}")
    lines += [_first_error(k, v) for k, v in s.get("first_errors", {}).items()]
    return "\n".join(lines)


def _first_error(status: str, message: str) -> str:
    """``  first STATUS: message`` on one line, shortened past MAX_ERROR_CHARS."""
    text = " ".join(message.split()) or "(no message)"
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS - 3] + "..."
    return f"  first {status}: {text}"


def format_sweep(runs: Sequence[dict]) -> str:
    head = (
        f"{'run':<16}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'goodput':>9}"
    )
    lines = [head]
    for run in runs:
        s = run["summary"]
        g = s.get("goodput")
        good = "-" if not g or g["share"] is None else f"{g['share'] * 100:.0f}%"
        lines.append(
            f"{run['label']:<16}{_num(s['request_throughput']):>8}"
            f"{_num(s['output_throughput'], '.1f'):>9}"
            f"{_ms(s['ttft_s']['p50']):>10}{_ms(s['ttft_s']['p99']):>10}"
            f"{_ms(s['tpot_s']['p50']):>10}{_ms(s['tpot_s']['p99']):>10}{good:>9}"
        )
    return "\n".join(lines)


def format_model(model: dict) -> str:
    return (
        f"model {model['name']}: vocab_size {model['vocab_size']}, "
        f"max_model_len {model['max_model_len']}"
    )


def format_report(report: dict) -> str:
    parts = [format_run(run) for run in report["runs"]]
    if report.get("model"):
        parts.insert(0, format_model(report["model"]))
    if len(report["runs"]) > 1:
        parts.append(format_sweep(report["runs"]))
    return "\n\n".join(parts)
