"""PNG plots: latency CDFs (one line per run) and, for a sweep, goodput and
throughput against the offered rate. matplotlib is imported lazily, with
the Agg backend, so the rest of the bench works without a display."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchkit.metrics import RequestRecord, e2e, itls, tpot, ttft

CDF_METRICS = {
    "ttft": ("TTFT", lambda recs: [ttft(r) for r in recs]),
    "tpot": ("TPOT", lambda recs: [tpot(r) for r in recs]),
    "itl": ("ITL", lambda recs: [x for r in recs for x in itls(r)]),
    "e2e": ("E2E latency", lambda recs: [e2e(r) for r in recs]),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], out_dir: Path) -> list[Path]:
    """``<metric>_cdf.png`` for TTFT, TPOT, ITL and E2E over the OK requests."""
    plt = _pyplot()
    paths = []
    for key, (title, values_of) in CDF_METRICS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs:
            xs = sorted(v * 1000 for v in values_of([r for r in records if r.ok]) if v is not None)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("share of requests" if key != "itl" else "share of tokens")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} CDF")
        ax.grid(True, alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
        path = out_dir / f"{key}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_sweep(runs: Sequence[dict], out_dir: Path) -> Path:
    """``sweep.png``: throughput and goodput (req/s, left) and goodput share
    (right) against the offered rate (runs at an infinite rate are left out)."""
    plt = _pyplot()
    runs = [run for run in runs if math.isfinite(run["load"]["rate"])]  # rate=inf has no x
    rates = [run["load"]["rate"] for run in runs]
    summaries = [run["summary"] for run in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(rates, [s["request_throughput"] or 0 for s in summaries], "o-", label="throughput")
    if all("goodput" in s for s in summaries):
        ax1.plot(rates, [s["goodput"]["rate"] or 0 for s in summaries], "s-", label="goodput")
        ax2.plot(rates, [(s["goodput"]["share"] or 0) * 100 for s in summaries], "s-")
        ax2.set_ylabel("requests meeting the SLO (%)")
        ax2.set_ylim(0, 102)
    else:
        ax2.plot(rates, [s["output_throughput"] or 0 for s in summaries], "o-")
        ax2.set_ylabel("output tokens/s")
    ax1.set_ylabel("requests/s")
    ax1.legend(fontsize="small")
    for ax in (ax1, ax2):
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out_dir / "sweep.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
