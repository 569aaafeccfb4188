"""Block index lookup cost: in-process, through a RedisIndex, and raw Redis.

Indexes ~100,000 blocks (128-block chains) over 8 workers, then times
``lookup`` of 128-hash chains that hit fully, hit half, and miss, on an
InMemoryIndex and on a RedisIndex (local after sync), plus what a lookup
would cost if it asked Redis each time: one pipeline of 128 SISMEMBER (one
worker) and of 128 x 8 (every worker). The last line printed is a JSON
object; times are microseconds per lookup.

    .venv/bin/python bench/index_lookup.py [--redis-url redis://...] [--lookups N]

Without --redis-url it starts its own redis-server on a free port.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the package

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence

import redis

from block_index import InMemoryIndex, KVEvent, RedisEventPublisher, RedisIndex, redis_prefix

CHAIN = 128
WORKERS = 8


def build_chains(total_blocks: int, seed: int = 0) -> list[list[bytes]]:
    rng = random.Random(seed)
    n = -(-total_blocks // CHAIN)
    return [[rng.randbytes(16) for _ in range(CHAIN)] for _ in range(n)]


def queries(chains: list[list[bytes]], n: int, seed: int = 1) -> dict[str, list[list[bytes]]]:
    rng = random.Random(seed)
    # fresh bytes objects, as a router computes them per request: not the
    # very objects used as dict keys (that would skip the key comparison)
    picks = [[h[:8] + h[8:] for h in rng.choice(chains)] for _ in range(n)]
    return {
        "hit": [list(c) for c in picks],
        "partial": [
            c[: CHAIN // 2] + [rng.randbytes(16) for _ in range(CHAIN // 2)] for c in picks
        ],
        "miss": [[rng.randbytes(16) for _ in range(CHAIN)] for _ in range(n)],
    }


def time_calls(fn: Callable[[Sequence[bytes]], object], qs: list[list[bytes]]) -> dict[str, float]:
    for q in qs[:50]:  # warm up
        fn(q)
    samples = []
    for q in qs:
        t0 = time.perf_counter_ns()
        fn(q)
        samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    return {
        "mean_us": round(statistics.fmean(samples), 2),
        "p50_us": round(samples[len(samples) // 2], 2),
        "p99_us": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 2),
    }


def check(index, chains: list[list[bytes]], owner: list[str], qs) -> None:
    c = qs["hit"][0]
    i = next(k for k, x in enumerate(chains) if x[0] == c[0])
    assert index.lookup(c) == {owner[i]: CHAIN}, index.lookup(c)
    assert index.lookup(qs["partial"][0]) == {owner[i]: CHAIN // 2}
    assert index.lookup(qs["miss"][0]) == {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--raw-lookups", type=int, default=300)
    args = ap.parse_args()

    chains = build_chains(args.blocks)
    owner = [f"prefill-{i % WORKERS}" for i in range(len(chains))]
    indexed = len(chains) * CHAIN
    qs = queries(chains, args.lookups)
    result: dict[str, object] = {
        "blocks_indexed": indexed,
        "workers": WORKERS,
        "chain_len": CHAIN,
        "lookups_per_case": args.lookups,
    }

    # -- in-process ------------------------------------------------------------
    mem = InMemoryIndex()
    t0 = time.perf_counter()
    for c, w in zip(chains, owner, strict=True):
        mem.apply(KVEvent(w, stored=tuple(c)))
    result["in_memory_index_build_s"] = round(time.perf_counter() - t0, 3)
    check(mem, chains, owner, qs)
    result["in_memory"] = {k: time_calls(mem.lookup, v) for k, v in qs.items()}
    print("in-process:", json.dumps(result["in_memory"]))

    # -- Redis -----------------------------------------------------------------
    server = None
    url = args.redis_url
    if url is None:
        from tests.redis_server import RedisServer

        server = RedisServer().start()
        url = server.url
    prefix = redis_prefix(f"bench-{random.Random().randrange(1 << 30)}", "index-lookup")
    raw = redis.Redis.from_url(url)
    pubs: list[RedisEventPublisher] = []
    index = None
    try:
        pubs = [
            RedisEventPublisher(url, prefix, f"prefill-{i}", stream_maxlen=1_000_000)
            for i in range(WORKERS)
        ]
        by_worker = {p.worker: p for p in pubs}
        for p in pubs:
            p.flush(30.0)
        t0 = time.perf_counter()
        for c, w in zip(chains, owner, strict=True):
            by_worker[w].publish(KVEvent(w, stored=tuple(c)))
        for p in pubs:
            assert p.flush(60.0), "publisher did not drain"
        result["redis_publish_s"] = round(time.perf_counter() - t0, 3)

        t0 = time.perf_counter()
        index = RedisIndex(url, prefix)
        assert index.wait_ready(30.0), "RedisIndex did not sync"
        deadline = time.monotonic() + 60.0
        while index.num_blocks() < indexed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert index.num_blocks() == indexed, (index.num_blocks(), indexed)
        result["redis_index_sync_s"] = round(time.perf_counter() - t0, 3)
        check(index, chains, owner, qs)
        result["redis_index_local"] = {k: time_calls(index.lookup, v) for k, v in qs.items()}
        print("RedisIndex (local):", json.dumps(result["redis_index_local"]))

        # event -> visible in the router's view
        lags = []
        rng = random.Random(2)
        for _ in range(20):
            h = rng.randbytes(16)
            t0 = time.perf_counter()
            pubs[0].publish(KVEvent(pubs[0].worker, stored=(h,)))
            while not index.lookup([h]):
                time.sleep(0.0002)
            lags.append((time.perf_counter() - t0) * 1000)
        result["redis_event_to_view_ms_p50"] = round(statistics.median(lags), 2)

        # what asking Redis on every lookup would cost
        n_raw = min(args.raw_lookups, args.lookups)

        def sismember_one(q: Sequence[bytes], worker: str = "prefill-0") -> object:
            pipe = raw.pipeline(transaction=False)
            key = f"{prefix}:blocks:{worker}"
            for h in q:
                pipe.sismember(key, h)
            return pipe.execute()

        def sismember_all(q: Sequence[bytes]) -> object:
            pipe = raw.pipeline(transaction=False)
            for i in range(WORKERS):
                key = f"{prefix}:blocks:prefill-{i}"
                for h in q:
                    pipe.sismember(key, h)
            return pipe.execute()

        hit_q = qs["hit"][:n_raw]
        result["raw_redis_pipeline_128_sismember"] = time_calls(sismember_one, hit_q)
        result["raw_redis_pipeline_128x8_sismember"] = time_calls(sismember_all, hit_q)
        print("raw Redis 128 SISMEMBER:", json.dumps(result["raw_redis_pipeline_128_sismember"]))
    finally:
        if index is not None:
            index.close()
        for p in pubs:
            p.close()
        try:
            keys = list(raw.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                raw.delete(*keys)
        except redis.RedisError:
            pass
        raw.close()
        if server is not None:
            server.close()

    print(json.dumps(result))


if __name__ == "__main__":
    main()
