"""Do a slow client's streams slow the others? TPOT of normal streams on one
decode worker with and without a client that reads one message a second.

A local deployment (Ray on loopback, the embedded tiny model unless
``--model``; one prefill and one decode worker, so every stream shares the
decode worker and the router). Each round runs ``--streams`` greedy
requests of ``--tokens`` tokens; "slow" rounds also run one request whose
client has a 1 KiB HTTP/2 window and reads one message a second (it is cut
at ``limits.max_unread_output_kb``, ``--bound-kb``; a new one starts when it
ends). Rounds alternate, so both see the same machine load. Reports the
median over rounds of the streams' mean TPOT (the router's figure, from the
final message), the ratio slow / alone, how many slow requests were cut,
and the router's peak unread bytes. The last line is one JSON object.

  python bench/slow_client.py [--rounds 5] [--streams 8] [--tokens 64] [--bound-kb 4]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # the repository root, not bench/ (which has an engine.py)

import argparse
import asyncio
import contextlib
import json
import os
import statistics

SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
PROMPT = "def fibonacci(n):\n    "


async def _slow_client(address: str, stop: asyncio.Event) -> int:
    """Requests read one message a second, one after another until ``stop``;
    returns how many were cut (RESOURCE_EXHAUSTED)."""
    import grpc

    from protos.tandem.v1 import generate_pb2_grpc
    from router.client import build_request

    cut = 0
    async with grpc.aio.insecure_channel(address, options=SMALL_WINDOW) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        while not stop.is_set():
            request = build_request(PROMPT, temperature=0, max_tokens=1500, ignore_eos=True)
            call = stub.Generate(request)
            try:
                while not stop.is_set() and (await call.read()) is not grpc.aio.EOF:
                    await asyncio.sleep(1.0)
            except grpc.aio.AioRpcError as e:
                cut += e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                call.cancel()
    return cut


async def _round(address: str, streams: int, tokens: int, slow: bool) -> tuple[float, int]:
    """The mean TPOT of ``streams`` requests, and slow requests cut meanwhile."""
    from router.client import TandemClient

    stop = asyncio.Event()
    slow_task = asyncio.ensure_future(_slow_client(address, stop)) if slow else None
    try:
        if slow_task is not None:
            await asyncio.sleep(2.0)  # its window is full, its queue building
        async with TandemClient(address) as client:
            outs = await asyncio.gather(
                *(
                    client.complete(f"{PROMPT}# {i}\n", temperature=0, max_tokens=tokens,
                                    ignore_eos=True)
                    for i in range(streams)
                )
            )  # fmt: skip
    finally:
        stop.set()
    cut = 0
    if slow_task is not None:
        with contextlib.suppress(Exception):
            cut = await slow_task
    return statistics.mean(o.timings.mean_tpot_s for o in outs), cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--bound-kb", type=int, default=4)
    parser.add_argument("--model", default=None, help="a model path or hub id; default: tiny")
    args = parser.parse_args()

    import ray

    from benchkit.deployment import Deployment
    from router.config import ServeConfig

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, _node_ip_address="127.0.0.2", include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    config = ServeConfig(
        engine={"model": args.model, "kv_cache_memory_mb": 64},
        pools={"prefill": 1, "decode": 1},
        routing={"prefix_routing": False},
        limits={"max_unread_output_kb": args.bound_kb},
    )
    deployment = Deployment(config)
    try:
        asyncio.run(_round(deployment.address, 2, 8, False))  # warm up
        alone, slow, cut = [], [], 0
        for _ in range(args.rounds):
            alone.append(
                asyncio.run(_round(deployment.address, args.streams, args.tokens, False))[0]
            )
            tpot, n = asyncio.run(_round(deployment.address, args.streams, args.tokens, True))
            slow.append(tpot)
            cut += n
            print(f"round: alone {alone[-1] * 1e3:.2f} ms, with a slow client {tpot * 1e3:.2f} ms")
        totals = deployment.server.metrics.unread
        result = {
            "streams": args.streams,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "bound_kb": args.bound_kb,
            "tpot_alone_ms": round(statistics.median(alone) * 1e3, 3),
            "tpot_with_slow_client_ms": round(statistics.median(slow) * 1e3, 3),
            "ratio": round(statistics.median(slow) / statistics.median(alone), 3),
            "slow_requests_cut": cut,
            "router_peak_unread_bytes": totals.peak_bytes,
            "leaked_blocks": deployment.wait_no_leaks(),
        }
        print(json.dumps(result))
    finally:
        deployment.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
