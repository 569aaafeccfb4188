"""``tandem bench --rate-schedule``: a run whose rate changes over time, its
SLO attainment per window and the pool sizes sampled from the router while
it ran (benchkit/schedule.py, windows.py, pools.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchkit.pools import PoolSampler
    from benchkit.runner import LoadSpec

DEFAULT_WINDOW_S = 10.0


def add_arguments(p: argparse.ArgumentParser, load: argparse._MutuallyExclusiveGroup) -> None:
    load.add_argument(
        "--rate-schedule",
        metavar="T:R,...|daily:LOW:PEAK",
        help="open loop at a rate that changes: steps (0:2,60:8,120:2 is 2 req/s from 0 s, "
        "8 from 60 s, 2 from 120 s; the last step lasts as long as the one before it "
        "unless --duration) or a day's shape in --duration s (LOW at 04:00, PEAK at 16:00)",
    )
    p.add_argument(
        "--bursts",
        metavar="AT:LEN:FACTOR,...",
        help="with --rate-schedule: the rate times FACTOR for LEN s from AT s",
    )
    p.add_argument(
        "--window",
        type=float,
        default=DEFAULT_WINDOW_S,
        metavar="S",
        help="with --rate-schedule: SLO attainment per S-second window (%(default)s)",
    )
    p.add_argument(
        "--metrics-url",
        metavar="URL",
        help="with --rate-schedule: the router's Prometheus /metrics, sampled for pool sizes "
        "(default: TARGET/metrics for an http:// target; none for gRPC)",
    )
    p.add_argument(
        "--pool-sample-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between two pool-size samples (%(default)s)",
    )


def schedule_load(args: argparse.Namespace) -> LoadSpec:
    """The LoadSpec of ``--rate-schedule``; ValueError says what is wrong."""
    from benchkit.runner import LoadSpec
    from benchkit.schedule import parse_bursts, parse_schedule

    if not args.window > 0 or not args.pool_sample_interval > 0:
        raise ValueError("--window and --pool-sample-interval must be positive")
    schedule = parse_schedule(args.rate_schedule, args.duration)
    if args.bursts:
        schedule = schedule.with_bursts(parse_bursts(args.bursts))
    return LoadSpec(
        schedule=schedule,
        burstiness=args.burstiness,
        seed=args.seed,
        num_requests=args.num_requests,
        duration_s=schedule.duration_s,
    )


def metrics_url(args: argparse.Namespace) -> str | None:
    if args.metrics_url:
        return args.metrics_url
    if args.target.startswith(("http://", "https://")):
        return args.target.rstrip("/") + "/metrics"
    return None


def run(
    args: argparse.Namespace,
    load: LoadSpec,
    conversations: Iterator,
    ca: bytes | None,
    on_done: Callable,
) -> tuple[list, float, PoolSampler | None]:
    """The run's records, its start (perf_counter) and the pool sampler used."""
    from benchkit.pools import PoolSampler
    from benchkit.runner import run_load

    url = metrics_url(args)
    sampler = PoolSampler(url, args.pool_sample_interval) if url else None
    started: list[float] = []

    def on_start(t: float) -> None:
        started.append(t)
        if sampler is not None:
            sampler.start(t)

    async def go() -> list:
        try:
            return await run_load(
                args.target,
                conversations,
                load,
                temperature=args.temperature,
                timeout_s=args.timeout,
                root_certificates=ca,
                on_done=on_done,
                on_start=on_start,
            )
        finally:
            if sampler is not None:
                await sampler.stop()

    records = asyncio.run(go())
    return records, started[0], sampler


def schedule_doc(
    args: argparse.Namespace,
    load: LoadSpec,
    records: list,
    start: float,
    sampler: PoolSampler | None,
) -> dict:
    """What the JSON report adds for a scheduled run: the schedule, the
    windows and the pool samples."""
    from benchkit.windows import window_stats, worst_attainment

    schedule = load.schedule
    assert schedule is not None
    windows = window_stats(
        records, start, args.window, schedule.duration_s, args.slo or {}, schedule
    )
    return {
        "spec": args.rate_schedule,
        "bursts": args.bursts,
        "duration_s": schedule.duration_s,
        "segments": [dataclasses.asdict(s) for s in schedule.segments],
        "expected_requests": schedule.expected(0, schedule.duration_s),
        "window_s": args.window,
        "windows": [dataclasses.asdict(w) for w in windows],
        "worst_window_attainment": worst_attainment(windows),
        "metrics_url": sampler.metrics_url if sampler else None,
        "pool_samples": [dataclasses.asdict(s) for s in sampler.samples] if sampler else [],
        "pool_sample_errors": sampler.errors if sampler else 0,
        "pool_sample_last_error": sampler.last_error if sampler else "",
    }


def format_windows(doc: dict) -> str:
    """A table of the windows: offered and sent rate, attainment, TTFT p90."""
    head = f"{'window (s)':<14}{'offered':>9}{'sent':>6}{'failed':>7}{'SLO met':>9}"
    lines = [head + f"{'TTFT p90':>10}"]
    for w in doc["windows"]:
        offered = "-" if w["offered_rate"] is None else f"{w['offered_rate']:.2f}"
        met = "-" if w["attainment"] is None else f"{w['attainment'] * 100:.0f}%"
        p90 = "-" if w["ttft_p90_s"] is None else f"{w['ttft_p90_s'] * 1000:.0f}"
        span = f"{w['start_s']:.0f}-{w['end_s']:.0f}"
        lines.append(f"{span:<14}{offered:>9}{w['sent']:>6}{w['failed']:>7}{met:>9}{p90:>10}")
    pools = doc["pool_samples"]
    if pools:
        sizes = sorted({(s["pool"], s["workers"]) for s in pools})
        lines.append("pool sizes seen: " + ", ".join(f"{p}={n}" for p, n in sizes))
    elif doc["metrics_url"] is None:
        lines.append("pool sizes: not sampled (give --metrics-url, or an http:// target)")
    else:
        lines.append(f"pool sizes: no sample from {doc['metrics_url']}")
    return "\n".join(lines)


def plot(doc: dict, out_dir: Path) -> Path:
    from benchkit.plots import plot_schedule
    from benchkit.pools import PoolSample
    from benchkit.windows import WindowStats

    windows = [WindowStats(**w) for w in doc["windows"]]
    samples = [PoolSample(**s) for s in doc["pool_samples"]]
    return plot_schedule(windows, samples, out_dir)
