"""`tandem plan`: profile the engine, simulate, recommend prefill/decode pool sizes."""

from __future__ import annotations

import argparse
import asyncio
import sys


def _length(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        pair = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return pair


def _slo(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "tpot_ms"):
            raise argparse.ArgumentTypeError(f"unknown SLO {key!r} (ttft_ms, tpot_ms)")
        try:
            out[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO value in {part!r}") from None
    return out


def _pools(text: str) -> tuple[int, int]:
    try:
        p, _, d = text.partition(":")
        pair = (int(p), int(d))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D, got {text!r}") from None
    if min(pair) < 1:
        raise argparse.ArgumentTypeError(f"expected P, D >= 1, got {text!r}")
    return pair


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="recommend prefill/decode pool sizes for a workload and SLOs")
    p.add_argument("--model", metavar="ID_OR_PATH", help="model to profile (default: embedded)")
    p.add_argument("--profile", metavar="FILE", help="use a saved profile; skips profiling")
    p.add_argument("--profile-out", metavar="FILE", help="save the measured profile here")
    p.add_argument(
        "--profiles",
        action="store_true",
        help="list the shipped profiles (for --simulate) and exit",
    )
    p.add_argument("--quick", action="store_true", help="profile a reduced grid (seconds)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads when profiling")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (%(default)s)")
    p.add_argument("--input-len", type=_length, default=(256, 256), metavar="N|LO:HI")
    p.add_argument("--output-len", type=_length, default=(64, 64), metavar="N|LO:HI")
    p.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    p.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: CV of the gaps")
    p.add_argument(
        "--slo",
        type=_slo,
        default={},
        metavar="ttft_ms=X,tpot_ms=Y",
        help="latency targets (default ttft_ms=1000,tpot_ms=100)",
    )
    p.add_argument("--attainment", type=float, default=0.9, help="target share meeting the SLO")
    p.add_argument("--max-workers", type=int, default=8, help="most prefill + decode workers")
    p.add_argument("--num-requests", type=int, default=500, help="simulated requests")
    p.add_argument("--prefill-token-budget", type=int, default=512, metavar="TOKENS")
    p.add_argument("--max-decode-seqs", type=int, default=256)
    p.add_argument("--kv-bandwidth-gbps", type=float, default=10.0, help="GB/s of a KV transfer")
    p.add_argument("--kv-latency-ms", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verify-target",
        metavar="HOST:PORT",
        help="replay a short load against this running server",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="start the planned pools here (and then the naive split) and replay a short load",
    )
    p.add_argument("--verify-requests", type=int, default=30)
    p.add_argument(
        "--workload",
        choices=["chat", "long", "multiturn"],
        help="plan on one of the named workloads' traces (at --rate) instead of --input-len"
        " and --output-len",
    )
    p.add_argument("--trace", metavar="FILE", help="plan on this saved trace")
    p.add_argument(
        "--verify-simulate",
        action="store_true",
        help="--verify: start simulated workers running --profile (engine.simulate)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="verify: measure the serving path's fixed costs on an idle probe first",
    )
    p.add_argument("--trace-out", metavar="FILE", help="save the trace planned on")
    p.add_argument(
        "--verify-pools",
        type=_pools,
        metavar="P:D",
        help="--verify-target: the pools the target runs (default: the plan's)",
    )


def command(args: argparse.Namespace) -> int:
    from planner.search import search
    from planner.simulator import SystemConfig, Workload

    err = sys.stderr
    if args.profiles:
        return _list_profiles()
    profile = _profile(args)
    if profile is None:
        return 2
    slo = {"ttft_ms": 1000.0, "tpot_ms": 100.0, **args.slo}
    ttft_s, tpot_s = slo["ttft_ms"] / 1e3, slo["tpot_ms"] / 1e3
    try:
        workload = Workload(
            rate=args.rate,
            input_len=args.input_len,
            output_len=args.output_len,
            arrival=args.arrival,
            cv=args.cv,
            num_requests=args.num_requests,
        )
        trace = _trace(args, workload, profile.vocab_size)
        base = SystemConfig(
            1,
            1,
            prefill_token_budget=args.prefill_token_budget,
            decode_token_budget=args.prefill_token_budget,
            max_decode_seqs=args.max_decode_seqs,
            kv_bytes_per_token=profile.kv_bytes_per_token,
            kv_bandwidth_Bps=args.kv_bandwidth_gbps * 1e9,
            kv_latency_s=args.kv_latency_ms / 1e3,
        )
        plan = search(
            trace,
            profile.prefill_s,
            profile.decode_step_s,
            ttft_slo_s=ttft_s,
            tpot_slo_s=tpot_s,
            target=args.attainment,
            max_workers=args.max_workers,
            base=base,
            seed=args.seed,
            step_cost=profile.step_s,
        )
    except ValueError as e:
        print(f"tandem plan: {e}", file=err)
        return 2
    if args.trace_out:
        trace.save(args.trace_out)

    print("profile:")
    print("  " + profile.describe().replace("\n", "\n  "))
    print(f"workload: {_describe(args, trace)}; SLO ttft {slo['ttft_ms']:g} ms,"
          f" tpot {slo['tpot_ms']:g} ms, target {args.attainment:.0%}")  # fmt: skip

    def line(label: str, c) -> str:
        s = c.summary
        return (
            f"{label}: prefill={c.num_prefill} decode={c.num_decode}"
            f"  attainment {c.attainment:.1%}  goodput {c.goodput:.2f} req/s"
            f"  ttft p90 {s['ttft_p90_ms']:.0f} ms  tpot p90 {s['tpot_p90_ms']:.1f} ms"
        )

    if plan.best is None:
        print(f"plan: none up to {args.max_workers} workers meets {args.attainment:.0%}")
    else:
        print(line("plan", plan.best))
    print(line("naive", plan.naive))
    if args.verify_target:
        pools = args.verify_pools or (plan.best and (plan.best.num_prefill, plan.best.num_decode))
        if not pools:
            print("verify: skipped (no plan; name the target's pools with --verify-pools)")
            return 1
        _verify(args, profile, trace, base, pools, ttft_s, tpot_s)
    elif args.verify:
        if plan.best is None:
            print("verify: skipped (no plan)")
            return 1
        for label, c in (("plan", plan.best), ("naive", plan.naive)):
            _verify_local(args, label, (c.num_prefill, c.num_decode), profile, trace, base,
                          ttft_s, tpot_s)  # fmt: skip
    return 0 if plan.best is not None else 1


def _profile(args):
    from planner.profile import run_profile
    from planner.profiles import load_profile

    err = sys.stderr
    if args.profile:
        try:
            profile = load_profile(args.profile)
        except (OSError, ValueError, TypeError) as e:
            print(f"tandem plan: cannot read profile {args.profile}: {e}", file=err)
            return None
    else:
        print("profiling the engine (in process)...", file=err, flush=True)
        profile = run_profile(
            args.model,
            quick=args.quick,
            num_threads=args.num_threads,
            seed=args.seed,
            log=lambda line: print("  " + line, file=err, flush=True),
        )
    if args.profile_out:
        profile.save(args.profile_out)
        print(f"profile saved to {args.profile_out}", file=err)
    return profile


def _trace(args, workload, vocab: int):
    from planner.simulator import make_trace
    from planner.trace import WORKLOADS, Trace

    if args.trace:
        try:
            return Trace.load(args.trace)
        except (OSError, KeyError, TypeError) as e:
            raise ValueError(f"cannot read trace {args.trace}: {e}") from None
    if args.workload:
        return WORKLOADS[args.workload](args.rate, args.num_requests, vocab, args.seed)
    return make_trace(workload, args.seed, vocab)


def _describe(args, trace) -> str:
    st = trace.stats()
    return (
        f"{trace.name}, {len(trace.requests)} requests at {st.rate:.3g} req/s,"
        f" prompts p10-p90 {st.prompt_lens[0]}-{st.prompt_lens[1]},"
        f" outputs {st.output_lens[0]}-{st.output_lens[1]}, shared prefix {st.prefix_share:.0%}"
    )


def _verify_local(args, label, pools, profile, trace, base, ttft_s, tpot_s) -> None:
    """Start the pools on a local Ray cluster (simulated workers with
    --verify-simulate) and replay against them; the model takes the
    deployment's settings."""
    import ray

    from benchkit.deployment import Deployment
    from planner.settings import system_for
    from router.config import ServeConfig
    from tandem_cli.ray_init import init_ray

    engine = {"simulate": args.profile} if args.verify_simulate else {"model": args.model}
    config = ServeConfig(
        engine=engine,
        pools={"prefill": pools[0], "decode": pools[1]},
        server={"port": 0},
    )
    system = system_for(config, profile.kv_bytes_per_token, simulated=args.verify_simulate)
    started = init_ray(config)
    deployment = Deployment(config)
    try:
        args.verify_target = deployment.address
        print(f"verify {label}: prefill={pools[0]} decode={pools[1]}")
        _verify(args, profile, trace, system, pools, ttft_s, tpot_s)
    finally:
        args.verify_target = None
        deployment.stop()
        if started:
            ray.shutdown()


def _verify(args, profile, trace, base, pools, ttft_s, tpot_s) -> int:
    """Replay the first --verify-requests requests of the trace and print the
    model's prediction for exactly those beside what was measured."""
    from planner.predict import SLO, predict_trace
    from planner.trace import Trace
    from planner.verify import compare, replay

    if args.calibrate:
        from planner.calibrate import fit, probe_trace

        probe = probe_trace(profile.vocab_size, args.seed)
        cal = fit(base, profile, probe, asyncio.run(replay(args.verify_target, probe)))
        base = cal.apply(base)
        print(
            f"calibration: {cal.fixed_s * 1e3:.1f} ms a request, {cal.step_s * 1e3:.2f} ms a step"
        )
    short = Trace(trace.name, trace.requests[: args.verify_requests])
    predicted = predict_trace(profile, short, *pools, base, SLO(ttft_s, tpot_s))
    print(
        f"verify: replaying {len(short.requests)} requests against {args.verify_target}...",
        file=sys.stderr,
        flush=True,
    )
    measured = asyncio.run(replay(args.verify_target, short))
    print(
        f"verify: measured attainment {measured.attainment(ttft_s, tpot_s):.1%}"
        f" (predicted {predicted.attainment:.1%}), {measured.errors} errors"
    )
    if measured.ttft_s:
        print(compare(short.name, predicted, measured).table())
    return 0


def _list_profiles() -> int:
    """One line per shipped profile: its name, what it is of, where it comes from."""
    from planner.profiles import load_profile, profile_names

    for name in profile_names():
        profile = load_profile(name)
        print(f"{name}\t{profile.model or '?'} on {profile.hardware or '?'}\t{profile.source}")
    return 0
