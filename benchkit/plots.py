"""PNG plots: latency CDFs (one line per run); for a sweep, goodput and
throughput against the offered rate; for a rate schedule, attainment per
window and pool sizes over time. matplotlib is imported lazily, with
the Agg backend, so the rest of the bench works without a display."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchkit.metrics import RequestRecord, e2e, itls, tpot, ttft
from benchkit.pools import PoolSample
from benchkit.windows import WindowStats

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


def plot_schedule(
    windows: Sequence[WindowStats],
    pools: Sequence[PoolSample],
    out_dir: Path,
    name: str = "schedule.png",
) -> Path:
    """``schedule.png``: SLO attainment per window with the offered and sent
    rates (top), and each pool's workers over time, with the autoscaler's
    target where the router exports one (bottom)."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    lefts = [w.start_s for w in windows]
    widths = [w.end_s - w.start_s for w in windows]
    shares = [100 * w.attainment if w.attainment is not None else 0 for w in windows]
    top.bar(lefts, shares, widths, align="edge", alpha=0.5, label="SLO attainment")
    top.set_ylabel("requests meeting the SLO (%)")
    top.set_ylim(0, 102)
    rates = top.twinx()
    mids = [w.start_s + (w.end_s - w.start_s) / 2 for w in windows]
    if all(w.offered_rate is not None for w in windows):
        offered = [w.offered_rate for w in windows]
        edges = [*lefts, windows[-1].end_s]
        rates.step(edges, [*offered, offered[-1]], where="post", label="offered")
    sent = [w.sent / (w.end_s - w.start_s) if w.end_s > w.start_s else 0 for w in windows]
    rates.plot(mids, sent, "k.", label="sent")
    rates.set_ylabel("requests/s")
    rates.legend(fontsize="small", loc="upper right")
    for pool in sorted({s.pool for s in pools}):
        mine = [s for s in pools if s.pool == pool]
        line = bottom.step([s.t_s for s in mine], [s.workers for s in mine], where="post")
        targets = [(s.t_s, s.target) for s in mine if s.target is not None]
        if targets:
            bottom.step(
                [t for t, _ in targets],
                [v for _, v in targets],
                "--",
                where="post",
                color=line[0].get_color(),
                label=f"{pool} target",
            )
        line[0].set_label(pool)
    bottom.set_ylabel("workers")
    most = max([s.workers for s in pools] + [s.target or 0 for s in pools], default=1)
    bottom.set_ylim(0, most + 1)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("time since the run's start (s)")
    if pools:
        bottom.legend(fontsize="small")
    else:
        bottom.text(0.5, 0.5, "no pool sizes sampled", ha="center", transform=bottom.transAxes)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = out_dir / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
