"""``tandem bench``: replay a workload against a running router and report
TTFT, TPOT, ITL, E2E, throughput and goodput (see ``benchkit``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tandem_cli import bench_schedule
from tandem_cli.tls_ca import add_tls_ca, read_tls_ca

if TYPE_CHECKING:
    from benchkit.runner import LoadSpec
    from router.model_info import ModelInfo

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_RATE = 4.0
DEFAULT_NUM_REQUESTS = 120


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return x


def _positive_int(text: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return x


def _rates(text: str) -> list[float]:
    rates = [_positive_float(t.strip()) for t in text.split(",") if t.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("expected comma-separated rates, e.g. 1,2,4")
    return rates


def _length(text: str):
    from benchkit.workload import parse_length

    try:
        return parse_length(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ratio(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return x


def _slo(text: str) -> dict[str, float]:
    from benchkit.metrics import parse_slo

    try:
        return parse_slo(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="replay a workload against a running router and report latencies",
        description=(
            "Replay a workload against a running tandem router. Without workload "
            f"options: Poisson arrivals at {DEFAULT_RATE:g} req/s, {DEFAULT_NUM_REQUESTS} "
            "requests, input 64:256 and output 32:64 random tokens. The router is asked "
            "first what model it serves: synthetic token ids stay within its vocabulary, "
            "and a workload that does not fit its max_model_len is refused."
        ),
    )
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="router gRPC address, or http://HOST:PORT for the HTTP front (%(default)s)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--rate",
        type=_positive_float,
        metavar="R",
        help=f"open loop: R requests/s (inf: all at once; default {DEFAULT_RATE:g})",
    )
    load.add_argument(
        "--rate-sweep",
        type=_rates,
        metavar="R1,R2,...",
        help="one open-loop run per rate, in turn (each with seed+i)",
    )
    load.add_argument(
        "--concurrency", type=_positive_int, metavar="N", help="closed loop: N requests in flight"
    )
    bench_schedule.add_arguments(p, load)
    p.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        metavar="B",
        help="gamma arrivals of shape B: 1 is Poisson, smaller is burstier (%(default)s)",
    )
    p.add_argument(
        "--num-requests",
        type=_positive_int,
        metavar="N",
        help=f"requests per run (default {DEFAULT_NUM_REQUESTS} unless --duration)",
    )
    p.add_argument(
        "--duration", type=_positive_float, metavar="S", help="start no request after S seconds"
    )
    p.add_argument(
        "--input-len",
        type=_length,
        default="64:256",
        metavar="N|LO:HI",
        help="prompt tokens, fixed or uniform (%(default)s)",
    )
    p.add_argument(
        "--output-len",
        type=_length,
        default="32:64",
        metavar="N|LO:HI",
        help="max_tokens (EOS ignored), fixed or uniform (%(default)s)",
    )
    p.add_argument(
        "--dataset",
        metavar="FILE.jsonl",
        help='prompts from JSONL: {"prompt": ...} or {"prompt_token_ids": [...]}, '
        'optional "max_tokens"',
    )
    p.add_argument(
        "--shared-prefix-ratio",
        type=_ratio,
        default=0.0,
        metavar="F",
        help="that share of each synthetic prompt is a prefix common to all (%(default)s)",
    )
    p.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        metavar="K",
        help="K-turn conversations: each turn = history + answers + a new message",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (%(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="(%(default)s)")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="deadline of each request (%(default)s)",
    )
    p.add_argument(
        "--slo",
        type=_slo,
        metavar="ttft_ms=X,tpot_ms=Y",
        help="goodput limits (keys: ttft_ms, tpot_ms, e2e_ms, itl_ms)",
    )
    p.add_argument(
        "--out", metavar="DIR", help="report folder (default bench-results/<timestamp>/)"
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_tls_ca(p)


class _Refused(Exception):
    """Printed as ``tandem bench: <message>``; the command exits with ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _conversations(
    args: argparse.Namespace, rows: list[dict] | None, seed: int, model: ModelInfo
) -> Iterator:
    from benchkit import workload

    if rows is not None:
        return workload.dataset_conversations(rows, args.output_len, seed=seed, turns=args.turns)
    return workload.synthetic_conversations(
        args.input_len,
        args.output_len,
        vocab_size=model.vocab_size,
        seed=seed,
        shared_prefix_ratio=args.shared_prefix_ratio,
        turns=args.turns,
    )


def _label(load) -> str:
    if load.schedule is not None:
        return "schedule"
    if load.concurrency is not None:
        return f"concurrency={load.concurrency}"
    label = f"rate={load.rate:g}"
    return (
        label
        if load.burstiness == 1.0 or math.isinf(load.rate)
        else f"{label} B={load.burstiness:g}"
    )


def _progress(total: int | None, label: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=label,
        unit="req",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def _dataset(args: argparse.Namespace) -> list[dict] | None:
    """The --dataset rows, or None for synthetic prompts."""
    from benchkit import workload

    if not args.dataset:
        return None
    if args.shared_prefix_ratio:
        raise _Refused("--shared-prefix-ratio is for synthetic prompts")
    try:
        rows = workload.load_jsonl(args.dataset)
    except (OSError, ValueError) as e:
        raise _Refused(str(e)) from None
    if args.turns > 1 and len({type(r["prompt"]) for r in rows}) > 1:
        raise _Refused("--turns needs all prompts text or all token ids")
    return rows


def _loads(args: argparse.Namespace) -> list[LoadSpec]:
    from benchkit.runner import LoadSpec

    if args.bursts and not args.rate_schedule:
        raise _Refused("--bursts is for --rate-schedule")
    if args.rate_schedule:
        try:
            return [bench_schedule.schedule_load(args)]
        except ValueError as e:
            raise _Refused(f"--rate-schedule: {e}") from None
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    limits = {"num_requests": num_requests, "duration_s": args.duration}
    if args.concurrency is not None:
        return [LoadSpec(concurrency=args.concurrency, seed=args.seed, **limits)]
    rates = args.rate_sweep or [args.rate or DEFAULT_RATE]
    return [
        LoadSpec(rate=r, burstiness=args.burstiness, seed=args.seed + i, **limits)
        for i, r in enumerate(rates)
    ]


def _served_model(args: argparse.Namespace, ca: bytes | None) -> ModelInfo:
    """What the target serves and its limits (exit 1 when it does not say)."""
    from benchkit.runner import ModelInfoError, fetch_model_info, wait_ready

    if not asyncio.run(wait_ready(args.target, root_certificates=ca)):
        raise _Refused(f"cannot reach {args.target}", code=1)
    try:
        return asyncio.run(fetch_model_info(args.target, root_certificates=ca))
    except ModelInfoError as e:
        raise _Refused(f"cannot get the served model from {args.target}: {e}", code=1) from None


def _check_fits(args: argparse.Namespace, rows: list[dict] | None, model: ModelInfo) -> None:
    """Refuse a workload the served model cannot take: token ids beyond its
    vocabulary, prompt plus max_tokens beyond max_model_len."""
    from benchkit import workload

    if rows is not None:
        problem = workload.dataset_fit_problem(rows, args.output_len, args.turns, model)
    elif model.vocab_size < 1:
        problem = f"{args.target} does not say its vocabulary size (needed for synthetic prompts)"
    else:
        problem = workload.synthetic_fit_problem(
            args.input_len, args.output_len, args.turns, model.max_model_len
        )
    if problem is not None:
        raise _Refused(problem)


def _run_one(
    args: argparse.Namespace, load: LoadSpec, conversations: Iterator, ca: bytes | None
) -> tuple[list, dict | None]:
    """One load's records, with a progress bar on stderr, and what a scheduled
    run adds to the report (None for others)."""
    from benchkit.runner import run_load

    total = load.num_requests
    if load.schedule is not None and total is None:
        total = round(load.schedule.expected(0, load.schedule.duration_s))
    bar = _progress(total, _label(load), not args.no_progress)
    failed = 0

    def done(rec) -> None:
        nonlocal failed
        failed += not rec.ok
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed, refresh=False)

    try:
        if load.schedule is not None:
            records, start, sampler = bench_schedule.run(args, load, conversations, ca, done)
            return records, bench_schedule.schedule_doc(args, load, records, start, sampler)
        return asyncio.run(
            run_load(
                args.target,
                conversations,
                load,
                temperature=args.temperature,
                timeout_s=args.timeout,
                root_certificates=ca,
                on_done=done,
            )
        ), None
    finally:
        bar.close()


def _run_doc(load: LoadSpec, records: list, slo: dict, schedule: dict | None) -> dict:
    from benchkit import metrics, report

    doc = {
        "label": _label(load),
        "load": {
            "rate": load.rate,
            "burstiness": load.burstiness if load.rate is not None else None,
            "concurrency": load.concurrency,
            "schedule": load.schedule is not None,
            "num_requests": load.num_requests,
            "duration_s": load.duration_s,
            "seed": load.seed,
        },
        "summary": metrics.summarize(records, slo),
        "requests": report.request_rows(records),
    }
    if schedule is not None:
        doc["schedule"] = schedule
    return doc


def _workload_doc(args: argparse.Namespace, rows: list[dict] | None) -> dict:
    return {
        "dataset": args.dataset,
        "input_len": None if rows else [args.input_len.low, args.input_len.high],
        "output_len": [args.output_len.low, args.output_len.high],
        "shared_prefix_ratio": args.shared_prefix_ratio,
        "turns": args.turns,
        "temperature": args.temperature,
        "seed": args.seed,
    }


def command(args: argparse.Namespace) -> int:
    try:
        return _bench(args)
    except _Refused as e:
        print(f"tandem bench: {e}", file=sys.stderr)
        return e.code


def _bench(args: argparse.Namespace) -> int:
    from benchkit import plots, report
    from benchkit.runner import is_http

    if is_http(args.target) and args.tls_ca:
        raise _Refused("--tls-ca is for a gRPC target (HOST:PORT)")
    ca = None if is_http(args.target) else read_tls_ca(args.tls_ca)
    rows = _dataset(args)
    loads = _loads(args)
    model = _served_model(args, ca)
    _check_fits(args, rows, model)

    out_dir = (
        Path(args.out)
        if args.out
        else (Path.cwd() / "bench-results" / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, run_records = [], []
    for load in loads:
        records, schedule = _run_one(args, load, _conversations(args, rows, load.seed, model), ca)
        runs.append(_run_doc(load, records, args.slo or {}, schedule))
        run_records.append((_label(load), records))

    doc = {
        "tool": "tandem bench",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "target": args.target,
        "model": dataclasses.asdict(model),
        "workload": _workload_doc(args, rows),
        "runs": runs,
    }
    json_path = report.write_json(doc, out_dir / "report.json")
    schedule_plot = None
    if not args.no_plots:
        plots.plot_cdfs(run_records, out_dir)
        if len(runs) > 1 and args.rate_sweep:
            plots.plot_sweep(runs, out_dir)
        if "schedule" in runs[0]:
            schedule_plot = bench_schedule.plot(runs[0]["schedule"], out_dir)
    print(report.format_report(doc))
    if "schedule" in runs[0]:
        print("\n" + bench_schedule.format_windows(runs[0]["schedule"]))
    print(f"\nreport: {json_path}")
    if schedule_plot is not None:
        print(f"plot: {schedule_plot}")
    if any(run["summary"]["completed"] == 0 for run in runs):
        print("tandem bench: a run had no successful request", file=sys.stderr)
        return 1
    return 0
