"""A deployment of simulated workers (engine/simulated.py) on this machine:
how long it takes to start, how much memory its workers hold, and how close
its latencies come to the profile's.

  python bench/simulated_workers.py [--prefill 8] [--decode 8] [--profile NAME]

Starts a local Ray cluster on loopback and the deployment in this process
(benchkit/deployment.py), then sends requests one at a time (batch 1) and
then all at once. Prints the start-up time, each worker process's resident
and proportional memory (RSS counts shared pages in every process, PSS
splits them), the CPU time a worker took to start and what the idle
workers use, and the measured TTFT and TPOT of the one-at-a-time requests
against the profile's prefill and decode step times (ratio measured /
profile: the simulation's overhead on this machine); then one JSON line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import ray
from ray._private import state as ray_state

from benchkit.deployment import Deployment
from planner.profiles import load_profile
from router.client import TandemClient
from router.config import ServeConfig


def _memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB."""
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_pids(deployment: Deployment) -> list[int]:
    backend = deployment.backend
    workers = backend.prefill.workers + backend.decode.workers
    return [ray_state.actors(w.actor._actor_id.hex())["Pid"] for w in workers]


async def _one_at_a_time(address: str, prompts, max_tokens: int):
    async with TandemClient(address) as client:
        return [
            await client.complete(p, temperature=0, max_tokens=max_tokens, ignore_eos=True)
            for p in prompts
        ]


async def _all_at_once(address: str, prompts, max_tokens: int):
    async with TandemClient(address) as client:
        return await asyncio.gather(
            *(
                client.complete(p, temperature=0, max_tokens=max_tokens, ignore_eos=True)
                for p in prompts
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--profile", default="llama-3.1-8b-h200")
    ap.add_argument("--kv-mb", type=int, default=2048, help="KV memory of the profiled model")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8, help="one-at-a-time requests")
    ap.add_argument("--burst", type=int, default=64, help="requests sent at once")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.perf_counter()
    ray.init(num_cpus=8, _node_ip_address="127.0.0.2", include_dashboard=False, log_to_driver=False)
    ray_s = time.perf_counter() - t0
    cheap = {"num_cpus": 0.25}
    config = ServeConfig(
        engine={"simulate": args.profile, "kv_cache_memory_mb": args.kv_mb},
        pools={
            "prefill": args.prefill,
            "decode": args.decode,
            "prefill_resources": cheap,
            "decode_resources": cheap,
        },
        limits={"max_queued_requests": max(256, args.burst)},
    )
    t1 = time.perf_counter()
    deployment = Deployment(config)
    start_s = time.perf_counter() - t1
    try:
        pids = _worker_pids(deployment)
        memory = [_memory_kib(pid) for pid in pids]
        start_cpu = [_cpu_s(pid) for pid in pids]
        rng = random.Random(0)
        vocab = profile.vocab_size
        prompts = [
            [rng.randrange(vocab) for _ in range(args.prompt_len)]
            for _ in range(args.requests + args.burst)
        ]
        serial = asyncio.run(
            _one_at_a_time(deployment.address, prompts[: args.requests], args.max_tokens)
        )
        t2 = time.perf_counter()
        burst = asyncio.run(
            _all_at_once(deployment.address, prompts[args.requests :], args.max_tokens)
        )
        burst_s = time.perf_counter() - t2
        leaks = deployment.wait_no_leaks()
        idle_before = [_cpu_s(pid) for pid in pids]
        time.sleep(5)
        idle_cpu = sum(_cpu_s(pid) for pid in pids) - sum(idle_before)
    finally:
        deployment.stop()
        ray.shutdown()
    ttft = statistics.median(o.timings.ttft_s for o in serial)
    tpot = statistics.median(o.timings.mean_tpot_s for o in serial)
    ctx = args.prompt_len + args.max_tokens / 2
    want_ttft = profile.prefill_s([args.prompt_len])
    want_tpot = profile.decode_step_s(1, ctx)
    rss = [r / 1024 for r, _ in memory]
    pss = [p / 1024 for _, p in memory]
    print(f"ray.init {ray_s:.1f} s; {len(memory)} workers started in {start_s:.1f} s")
    print(
        f"per worker: RSS {statistics.mean(rss):.0f} MiB (max {max(rss):.0f}), "
        f"PSS {statistics.mean(pss):.0f} MiB; all workers: PSS {sum(pss) / 1024:.2f} GiB"
    )
    print(
        f"CPU to start a worker: {statistics.mean(start_cpu):.1f} s; "
        f"all workers idle: {idle_cpu / 5:.3f} cores"
    )
    print(f"TTFT {ttft * 1e3:.1f} ms (profile {want_ttft * 1e3:.1f})")
    print(f"TPOT {tpot * 1e3:.2f} ms (profile {want_tpot * 1e3:.2f})")
    tokens = sum(len(o.token_ids) for o in burst)
    print(f"{args.burst} requests at once: {burst_s:.1f} s, {tokens / burst_s:.0f} tokens/s")
    print(
        json.dumps(
            {
                "workers": len(memory),
                "start_s": round(start_s, 2),
                "ray_init_s": round(ray_s, 2),
                "worker_start_cpu_s": round(statistics.mean(start_cpu), 2),
                "idle_cores": round(idle_cpu / 5, 3),
                "worker_rss_mib": round(statistics.mean(rss), 1),
                "worker_pss_mib": round(statistics.mean(pss), 1),
                "workers_pss_gib": round(sum(pss) / 1024, 3),
                "ttft_ratio": round(ttft / want_ttft, 3),
                "tpot_ratio": round(tpot / want_tpot, 3),
                "burst_tokens_per_s": round(tokens / burst_s, 1),
                "leaked_blocks": sum(leaks.values()),
            }
        )
    )


if __name__ == "__main__":
    main()
