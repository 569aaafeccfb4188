"""How far the planner's predictions are from what a deployment does.

Three workloads (planner/trace.py: chat, long RAG-like prompts, multi-turn
conversations sharing prefixes), each a seeded trace, run twice: through
the planner's model (planner/simulator.py) and replayed against a local
deployment of simulated workers (the real router, Ray workers, scheduler,
prefix caches and KV transfer; the forward pass replaced by the profile's
step time, engine/simulated.py). First an idle probe measures the
serving path's costs outside the profile's step times (planner/calibrate.py:
a fixed cost per request and one per engine step); the model then counts
them on every trace. Per workload it prints predicted against
measured p50 and p90 TTFT and TPOT with the relative error, and the
per-request differences (the same requests, in the same order, so the
model's mistakes show where they are). Last line: a JSON object with
``max_p50_error`` and ``max_p90_error`` (fractions, over the workloads and
both metrics) and the per-workload figures.

  python bench/planner_accuracy.py [--profile NAME] [--prefill 2 --decode 2]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import os

import numpy as np

from planner.calibrate import fit, probe_trace
from planner.predict import Prediction
from planner.settings import system_for
from planner.trace import WORKLOADS, Trace
from planner.verify import compare, replay

# (requests per second, requests) per workload for 2 + 2 workers of the default profile:
# busy enough that queues, batches and KV room matter, short enough to run in a minute each.
LOADS = {"chat": (12.0, 80), "long": (2.0, 40), "multiturn": (8.0, 80)}
DEFAULT_PROFILE = "llama-3.3-70b-fp8-tp2-h100"


def serve_config(profile: str, prefill: int, decode: int, kv_mb: int):
    from router.config import ServeConfig

    return ServeConfig(
        engine={"simulate": profile, "kv_cache_memory_mb": kv_mb, "max_model_len": 16384},
        pools={"prefill": prefill, "decode": decode, "cpu_binding": False},
        server={"port": 0},
    )


def per_request(name: str, pred_res, measured) -> dict[str, float]:
    """Mean and spread of (predicted - measured) over the same requests, ms."""
    idx = measured.index
    p_ttft = np.array([pred_res.requests[i].ttft for i in idx])
    p_tpot = np.array([pred_res.requests[i].tpot for i in idx])
    d_ttft = (p_ttft - np.array(measured.ttft_s)) * 1e3
    d_tpot = (p_tpot - np.array(measured.tpot_s)) * 1e3
    out = {
        "ttft_diff_mean_ms": float(d_ttft.mean()),
        "ttft_diff_p10_ms": float(np.percentile(d_ttft, 10)),
        "ttft_diff_p90_ms": float(np.percentile(d_ttft, 90)),
        "tpot_diff_mean_ms": float(d_tpot.mean()),
        "tpot_diff_p10_ms": float(np.percentile(d_tpot, 10)),
        "tpot_diff_p90_ms": float(np.percentile(d_tpot, 90)),
    }
    print(
        f"  per request (predicted - measured): ttft mean {out['ttft_diff_mean_ms']:+.1f} ms"
        f" (p10 {out['ttft_diff_p10_ms']:+.1f}, p90 {out['ttft_diff_p90_ms']:+.1f}),"
        f" tpot mean {out['tpot_diff_mean_ms']:+.2f} ms"
        f" (p10 {out['tpot_diff_p10_ms']:+.2f}, p90 {out['tpot_diff_p90_ms']:+.2f})"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--kv-cache-mb", type=int, default=8192, help="each worker's KV pool")
    ap.add_argument("--workloads", default="chat,long,multiturn")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every workload's requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-traces", metavar="DIR")
    args = ap.parse_args()

    import ray

    from benchkit.deployment import Deployment
    from planner.profiles import load_profile
    from planner.simulator import simulate

    profile = load_profile(args.profile)
    config = serve_config(args.profile, args.prefill, args.decode, args.kv_cache_mb)
    system = system_for(config, profile.kv_bytes_per_token, simulated=True)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=16, _node_ip_address="127.0.0.2", include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    deployment = Deployment(config)
    results: dict[str, dict] = {}
    try:
        probe = probe_trace(profile.vocab_size, args.seed)
        cal = fit(system, profile, probe, asyncio.run(replay(deployment.address, probe)))
        local = f"{cal.local_s * 1e3:.1f}" if cal.local_s is not None else "-"
        print(f"calibration (idle probe): {cal.fixed_s * 1e3:.1f} ms a request ({local} ms"
              f" prefilled on its decode worker), {cal.step_s * 1e3:.2f} ms a step beyond"
              " the profile", flush=True)  # fmt: skip
        system = cal.apply(system)
        for name in args.workloads.split(","):
            rate, n = LOADS[name]
            trace: Trace = WORKLOADS[name](rate, max(4, round(n * args.scale)),
                                           profile.vocab_size, args.seed)  # fmt: skip
            if args.save_traces:
                trace.save(Path(args.save_traces) / f"{name}.json")
            res = simulate(trace, system, profile.prefill_s, profile.decode_step_s,
                           step_cost=profile.step_s)  # fmt: skip
            predicted = Prediction.of(res)
            print(f"{name}: {len(trace.requests)} requests at {rate:g}/s,"
                  f" {trace.stats().prefix_share:.0%} shared prefix", flush=True)  # fmt: skip
            measured = asyncio.run(replay(deployment.address, trace))  # a loop of its own
            c = compare(name, predicted, measured)
            print(c.table())
            results[name] = {**c.to_dict(), **per_request(name, res, measured)}
            results[name]["prefix_hit_share_predicted"] = round(res.prefix_hit_share, 3)
            results[name]["max_p50_error"] = round(c.max_error("p50"), 4)
            results[name]["max_p90_error"] = round(c.max_error("p90"), 4)
        leaks = deployment.wait_no_leaks()
    finally:
        deployment.stop()
        ray.shutdown()
    out = {
        "max_p50_error": max(r["max_p50_error"] for r in results.values()),
        "max_p90_error": max(r["max_p90_error"] for r in results.values()),
        "profile": args.profile,
        "pools": f"{args.prefill}+{args.decode}",
        "calibration_ms": {
            "fixed": round(cal.fixed_s * 1e3, 2),
            "step": round(cal.step_s * 1e3, 3),
        },
        "leaked_blocks": leaks,
        "workloads": results,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
