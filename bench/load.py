"""Load benchmark: 1,000 concurrent streams through the router on the default
tiny model (not a timed test).

`tandem serve` runs in its own process (1 prefill + 1 decode worker, as
bench/serving.py starts it, with max_queued_requests raised above the load);
the client opens every stream at once over a few gRPC channels and checks
each one: a final message, exactly ``--max-tokens`` tokens, no error status.
Before and after, Admin.Status (with an admin key made for the run) gives
every worker's free block count: they must match (no leak). The baseline,
in the same run on the same server, is 64 concurrent streams. The last line is one JSON object.

  python bench/load.py [--streams 1000] [--max-tokens 32] [--secure]

``--secure`` serves with everything on (router TLS, cluster mutual TLS and a
cluster secret; throwaway certificates made with openssl).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import collections
import contextlib
import json
import os
import tempfile
import time

import grpc
import torch

from benchkit.local_serve import tandem_serve
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.auth import ADMIN_KEYS_ENV, client_metadata
from router.client import TandemClient

PROMPT_TOKENS = 32
ADMIN_KEY = os.urandom(16).hex()  # the served router's admin key (Admin.Status)


@contextlib.contextmanager
def serve(extra_yaml: str, env_extra: dict[str, str]):
    """`tandem serve` in a subprocess; yields its address."""
    config = (
        "engine: {kv_cache_memory_mb: 256}\nserver: {port: 0}\n"
        "limits: {max_queued_requests: 4096}\n" + extra_yaml
    )
    flags = ("--prefill", "1", "--decode", "1")
    env = {ADMIN_KEYS_ENV: ADMIN_KEY, **env_extra}
    with tandem_serve(config, flags, env) as (address,):
        yield address


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(n)]


async def run_load(
    address: str, n: int, max_tokens: int, channels: int, ca: bytes | None
) -> tuple[float, collections.Counter[str], int]:
    """(seconds, outcome counts, tokens received) for n concurrent streams."""
    outcomes: collections.Counter[str] = collections.Counter()
    tokens = 0

    async def one(client: TandemClient, prompt: list[int]) -> None:
        nonlocal tokens
        got, final = 0, None
        try:
            async for r in client.generate(
                prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True
            ):
                if r.HasField("chunk"):
                    got += len(r.chunk.token_ids)
                else:
                    final = r.final
        except grpc.aio.AioRpcError as e:
            outcomes[e.code().name] += 1
            return
        tokens += got
        if final is None or got != max_tokens or final.usage.completion_tokens != got:
            outcomes["incomplete"] += 1
        else:
            outcomes["ok"] += 1

    clients = [TandemClient(address, 600, root_certificates=ca) for _ in range(channels)]
    async with contextlib.AsyncExitStack() as stack:
        for c in clients:
            await stack.enter_async_context(c)
        batch = prompts(n, seed=n)
        start = time.perf_counter()
        await asyncio.gather(*(one(clients[i % channels], p) for i, p in enumerate(batch)))
        elapsed = time.perf_counter() - start
    return elapsed, outcomes, tokens


async def free_blocks(address: str, ca: bytes | None) -> dict[str, int]:
    if ca is None:
        channel = grpc.aio.insecure_channel(address)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=ca)
        channel = grpc.aio.secure_channel(address, creds)
    async with channel:
        metadata = client_metadata(ADMIN_KEY)
        reply = await admin_pb2_grpc.AdminStub(channel).Status(
            admin_pb2.StatusRequest(), metadata=metadata
        )
    return {w.name: w.free_blocks for w in reply.workers}


async def settled_free_blocks(address: str, ca: bytes | None, want: dict[str, int]) -> dict:
    """Free blocks once aborts and releases have run (or after 30 s)."""
    deadline = time.monotonic() + 30
    while (now := await free_blocks(address, ca)) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return now


def secure_settings(directory: Path) -> tuple[str, dict[str, str], bytes]:
    from tests.tls_certs import make_certs

    certs = make_certs(directory, "bench")
    yaml = (
        f"security:\n  tls_cert: {certs.cert}\n  tls_key: {certs.key}\n"
        f"  cluster_tls_cert: {certs.cert}\n  cluster_tls_key: {certs.key}\n"
        f"  cluster_tls_ca: {certs.ca}\n"
    )
    return yaml, {"TANDEM_CLUSTER_SECRET": os.urandom(16).hex()}, certs.ca.read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--baseline-streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--channels", type=int, default=8, help="gRPC channels the client uses")
    parser.add_argument("--secure", action="store_true", help="TLS everywhere + cluster secret")
    args = parser.parse_args()
    yaml, env, ca = "", {}, None
    with tempfile.TemporaryDirectory() as tmp:
        if args.secure:
            yaml, env, ca = secure_settings(Path(tmp))
        results: dict = {"secure": args.secure, "max_tokens": args.max_tokens}
        with serve(yaml, env) as address:
            asyncio.run(run_load(address, 4, 4, 1, ca))  # warm up
            before = asyncio.run(free_blocks(address, ca))
            for name, n in (("baseline", args.baseline_streams), ("load", args.streams)):
                elapsed, outcomes, tokens = asyncio.run(
                    run_load(address, n, args.max_tokens, args.channels, ca)
                )
                errors = n - outcomes["ok"]
                results[name] = {
                    "streams": n,
                    "seconds": round(elapsed, 2),
                    "errors": errors,
                    "outcomes": dict(outcomes),
                    "tokens": tokens,
                    "tok_s": round(tokens / elapsed, 1),
                }
                print(f"{name}: {results[name]}", flush=True)
            after = asyncio.run(settled_free_blocks(address, ca, before))
    results["leaked_blocks"] = {
        w: before[w] - after.get(w, 0) for w in before if before[w] != after.get(w)
    }
    results["load_vs_baseline_tok_s"] = round(
        results["load"]["tok_s"] / max(results["baseline"]["tok_s"], 1e-9), 2
    )
    print(
        f"{args.streams} streams: {results['load']['seconds']} s, "
        f"errors {results['load']['errors']}, {results['load']['tok_s']} tok/s "
        f"({results['load_vs_baseline_tok_s']}x of {args.baseline_streams} streams), "
        f"leaked blocks {results['leaked_blocks'] or 0}",
        flush=True,
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
