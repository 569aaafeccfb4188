"""TTFT of a bursty load on a decode pool too small for its bursts: the
admission queue (requests wait for KV room) against the retry path it
replaced (a full decode worker refuses the push, the router prefills the
request again elsewhere; benchkit/no_admission.py), same run, same load.

  python bench/admission.py [--bursts 4] [--burst 24] [--gap-s 1.5] [--prompt-len 24]
  python bench/admission.py --heavy   # --burst 48 --prompt-len 96


Both deployments run in this process on a local Ray cluster on loopback:
1 prefill and 2 decode workers, each with 1 MiB of KV (16 blocks of the
default model: about four of the default requests at a time), so each
burst fills the pool and it drains during the gap. ``--heavy`` sends
twice the requests per burst with four times longer prompts (7 of a
worker's 16 blocks each: two at a time per worker), a load where the
retry path runs out of its ``tuning.max_attempts`` tries. Every request is greedy,
with a fresh prompt (no prefix-cache hits). Prints each path's TTFT p50
and p99 (client-side, to the first token) and its failed requests by
status, its tries retried, the decode workers' preemptions and the end to
end p99; the ratio of the TTFT p99s (retry / queueing); then one JSON line.
Failed requests have no TTFT: a path that fails requests looks faster.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import collections
import json
import os
import time

import grpc
import ray

from benchkit.deployment import Deployment
from benchkit.metrics import percentile
from benchkit.no_admission import RefusingDecodeActor, RetryBackend
from router.client import TandemClient
from router.config import ServeConfig

CONFIG = ServeConfig(
    engine={"kv_cache_memory_mb": 1},
    pools={"prefill": 1, "decode": 2},
    routing={"prefix_routing": False},
    limits={"max_queued_requests": 4096},
)
GREEDY = {"temperature": 0, "ignore_eos": True}


HEAVY = (48, 48, 64)  # --burst, --prompt-len, --max-tokens of --heavy
HEAVY_ARGS = "--burst {} --prompt-len {} --max-tokens {}".format(*HEAVY)

Result = tuple[float | None, float | None, str]  # (TTFT, end to end, status)


async def _one(client: TandemClient, prompt: list[int], max_tokens: int) -> Result:
    start = time.perf_counter()
    ttft = None
    try:
        async for response in client.generate(prompt, max_tokens=max_tokens, **GREEDY):
            if ttft is None and response.HasField("chunk"):
                ttft = time.perf_counter() - start
        return ttft, time.perf_counter() - start, "OK"
    except grpc.aio.AioRpcError as exc:
        return None, None, exc.code().name


async def _load(address: str, args, seed: int) -> list[Result]:
    results = []
    async with TandemClient(address) as client:
        for b in range(args.bursts):
            prompts = [
                [(seed * 7919 + b * 997 + i * 31 + j) % 30000 + 100 for j in range(args.prompt_len)]
                for i in range(args.burst)
            ]
            results += await asyncio.gather(*(_one(client, p, args.max_tokens) for p in prompts))
            await asyncio.sleep(args.gap_s)
    return results


def _measure(name: str, deployment: Deployment, args, seed: int) -> dict:
    try:
        before = deployment.worker_stats()
        results = asyncio.run(_load(deployment.address, args, seed))
        after = deployment.worker_stats()
        retries = deployment.backend.failover.retries
    finally:
        deployment.stop()
    ttfts = [t for t, _, _ in results if t is not None]
    e2e = [e for _, e, _ in results if e is not None]
    failed = collections.Counter(code for _, _, code in results if code != "OK")
    row = {
        "requests": len(results),
        "failed": dict(failed),
        "retries": retries,
        "preemptions": sum(s.num_preemptions - before[n].num_preemptions for n, s in after.items()),
        "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
        "ttft_p99_s": round(percentile(ttfts, 99), 4) if ttfts else None,
        "e2e_p99_s": round(percentile(e2e, 99), 4) if e2e else None,
    }
    print(f"{name:9s} {row}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--burst", type=int, default=24)
    parser.add_argument("--gap-s", type=float, default=1.5)
    parser.add_argument("--prompt-len", type=int, default=24, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--heavy", action="store_true", help=f"the heavier load: {HEAVY_ARGS}")
    args = parser.parse_args()
    if args.heavy:
        args.burst, args.prompt_len, args.max_tokens = HEAVY
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, _node_ip_address="127.0.0.2", include_dashboard=False, log_to_driver=False)
    try:
        queueing = _measure("queueing", Deployment(CONFIG), args, seed=1)
        baseline = Deployment(CONFIG, {"decode": RefusingDecodeActor}, RetryBackend)
        retry = _measure("retry", baseline, args, seed=2)
    finally:
        ray.shutdown()
    ratio = None
    if queueing["ttft_p99_s"] and retry["ttft_p99_s"]:
        ratio = round(retry["ttft_p99_s"] / queueing["ttft_p99_s"], 3)
    print(f"TTFT p99 retry / queueing: {ratio}")
    load = {
        "bursts": args.bursts,
        "burst": args.burst,
        "gap_s": args.gap_s,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
    }
    print(json.dumps({"bench": "admission", "load": load, "queueing": queueing, "retry": retry,
                      "p99_ratio_retry_over_queueing": ratio}))  # fmt: skip


if __name__ == "__main__":
    main()
