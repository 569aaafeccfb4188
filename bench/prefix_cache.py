"""Prefix caching across pools: what it saves, same run, default tiny model.

  1. TTFT of a ~2,048-token prompt whose first 1,843 tokens (90% of 2,048)
     are cached, vs the same length cold (1 prefill + 1 decode worker,
     128 MiB KV pool each; target warm/cold <= 0.2). The warm request is
     measured twice: as the router routes it by default (the decode worker
     holds the prefix and prefills the short tail itself when it is at most
     local_prefill_tokens long), and with local_prefill_tokens=0 (the prefill
     worker reuses its own cached prefix and pushes only the tail's blocks).
  2. An 8-turn conversation workload (4 conversations in parallel; each turn
     adds a 48-token user message; 32 output tokens per turn) with prefix
     caching on and off: cache hit rate, TTFT per turn, total wall time.
  3. The router's per-request index lookup cost with 100,000 blocks indexed,
     in-process and through Redis (from bench/index_lookup.py), plus the cost
     of hashing the prompt's blocks that comes with every lookup.

The measured prompts have 2,048 tokens and 8 output tokens, the 1,843-token
prefix being 90% of them. A request that ends on its first token skips the KV
push (and never reaches the decode worker, whose cache the local path needs),
so every request here decodes a few tokens; TTFT includes the push, as in real
serving.
The last line is one JSON object with the figures.

  python bench/prefix_cache.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import asyncio
import json
import os
import statistics
import subprocess
import time
from collections.abc import Sequence

import torch

from benchkit.deployment import Deployment
from engine.hashing import hash_blocks, root_hash
from router.client import Completion, TandemClient, collect
from router.config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
MEASURED_TOKENS = 2048
OUT_TOKENS = 8
PREFIX_TOKENS = 1843  # 90% of 2,048
REPEATS = 3
KV_MB = 128

TURNS = 8
CONVERSATIONS = 4
USER_TOKENS = 48
ANSWER_TOKENS = 32

T0 = time.perf_counter()


def log(*args: object) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s]", *args, flush=True)


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 30000, (n,), generator=gen).tolist()


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ms(x: float) -> float:
    return round(x * 1e3, 2)


async def timed_complete(
    client: TandemClient, prompt: list[int], max_tokens: int
) -> tuple[Completion, float]:
    """The completion and the client-side time to its first chunk (seconds)."""
    start = time.perf_counter()
    first = 0.0
    responses = []
    async for r in client.generate(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True):
        if not first and r.HasField("chunk") and r.chunk.token_ids:
            first = time.perf_counter() - start
        responses.append(r)
    return collect(responses), first


def run(coro):
    return asyncio.run(coro)


# -- 1. TTFT, 90% cached vs cold ------------------------------------------------


def kv_bytes(d: Deployment) -> tuple[int, int]:
    """KV bytes pushed to decode workers and pulled between workers, so far."""
    stats = d.worker_stats().values()
    return (
        sum(s.kv_bytes_pushed for s in stats),
        sum(s.kv_bytes_pulled for s in stats),
    )


def record(out: Completion, client_s: float, moved: tuple[int, int]) -> dict:
    rec = {
        "ttft_ms": ms(out.timings.ttft_s),
        "client_first_chunk_ms": ms(client_s),
        "prompt_tokens": out.usage.prompt_tokens,
        "cached_tokens": out.usage.cached_tokens,
        "path": "local" if out.timings.prefill_worker == out.timings.decode_worker else "prefill",
        "prefill_worker": out.timings.prefill_worker,
        "decode_worker": out.timings.decode_worker,
    }
    rec["kv_bytes_pushed"], rec["kv_bytes_pulled"] = moved
    return rec


def summarize(recs: list[dict]) -> dict:
    return {
        "ttft_ms_p50": round(med([r["ttft_ms"] for r in recs]), 2),
        "client_first_chunk_ms_p50": round(med([r["client_first_chunk_ms"] for r in recs]), 2),
        "cached_tokens": [r["cached_tokens"] for r in recs],
        "paths": [r["path"] for r in recs],
        "ttft_ms": [r["ttft_ms"] for r in recs],
        "kv_bytes_pushed": [r["kv_bytes_pushed"] for r in recs],
        "kv_bytes_pulled": [r["kv_bytes_pulled"] for r in recs],
    }


def bench_ttft(d: Deployment) -> dict:
    async def one(prompt: list[int], max_tokens: int) -> tuple[Completion, float]:
        async with TandemClient(d.address) as client:
            return await timed_complete(client, prompt, max_tokens)

    def measured(prompt: list[int]) -> dict:
        before = kv_bytes(d)
        out, client_s = run(one(prompt, OUT_TOKENS))
        after = kv_bytes(d)
        return record(out, client_s, (after[0] - before[0], after[1] - before[1]))

    # warm the whole path up (actors, gRPC channels, first-call costs)
    for seed in (900, 901):
        run(one(tokens(MEASURED_TOKENS, seed), OUT_TOKENS))

    cold, warm_local, warm_prefill = [], [], []
    for i in range(REPEATS):
        cold.append(measured(tokens(MEASURED_TOKENS, 1000 + i)))
        log(f"cold  #{i}", json.dumps(cold[-1]))

    def warm_case(seed: int) -> dict:
        prefix = tokens(PREFIX_TOKENS, seed)
        tail = MEASURED_TOKENS - PREFIX_TOKENS
        first, _ = run(one(prefix + tokens(tail, seed + 1), OUT_TOKENS))
        rec = measured(prefix + tokens(tail, seed + 2))
        rec["warmup_cached_tokens"] = first.usage.cached_tokens
        return rec

    for i in range(REPEATS):
        warm_local.append(warm_case(2000 + 10 * i))
        log(f"warm (default routing) #{i}", json.dumps(warm_local[-1]))

    routing = d.backend.routing
    assert routing is not None
    saved = routing.local_prefill_tokens
    routing.local_prefill_tokens = 0  # every prompt through the prefill pool
    try:
        for i in range(REPEATS):
            warm_prefill.append(warm_case(3000 + 10 * i))
            log(f"warm (local_prefill_tokens=0) #{i}", json.dumps(warm_prefill[-1]))
    finally:
        routing.local_prefill_tokens = saved

    c, wl, wp = summarize(cold), summarize(warm_local), summarize(warm_prefill)
    return {
        "prompt_tokens": MEASURED_TOKENS,
        "prefix_tokens": PREFIX_TOKENS,
        "expected_cached_tokens": PREFIX_TOKENS // BLOCK * BLOCK,
        "cold": c,
        "warm_default_routing": wl,
        "warm_local_prefill_0": wp,
        "ratio_warm_default_vs_cold": round(wl["ttft_ms_p50"] / c["ttft_ms_p50"], 3),
        "ratio_warm_local_prefill_0_vs_cold": round(wp["ttft_ms_p50"] / c["ttft_ms_p50"], 3),
        "ratio_client_warm_default_vs_cold": round(
            wl["client_first_chunk_ms_p50"] / c["client_first_chunk_ms_p50"], 3
        ),
        "ratio_client_warm_local_prefill_0_vs_cold": round(
            wp["client_first_chunk_ms_p50"] / c["client_first_chunk_ms_p50"], 3
        ),
        "index_blocks_after": d.backend.index.num_blocks() if d.backend.index else None,
    }


# -- 2. multi-turn conversations ---------------------------------------------------


def expected_cached(history_len: int) -> int:
    """What the decode worker can reuse on the next turn: it holds the previous
    turn's prompt and answer (``history_len`` tokens), all but the last answer
    token's KV (never computed); full blocks only."""
    return (history_len - 1) // BLOCK * BLOCK


async def conversation(client: TandemClient, conv: int) -> list[dict]:
    history: list[int] = []
    turns = []
    for turn in range(1, TURNS + 1):
        prompt = history + tokens(USER_TOKENS, 10_000 + 100 * conv + turn)
        out, client_s = await timed_complete(client, prompt, ANSWER_TOKENS)
        turns.append(
            {
                "turn": turn,
                "prompt_tokens": out.usage.prompt_tokens,
                "cached_tokens": out.usage.cached_tokens,
                "completion_tokens": out.usage.completion_tokens,
                "ttft_s": out.timings.ttft_s,
                "client_s": client_s,
                "local": out.timings.prefill_worker == out.timings.decode_worker,
                "expected_cached": expected_cached(len(history)) if turn > 1 else 0,
            }
        )
        history = prompt + out.token_ids
    return turns


def bench_conversations(d: Deployment, caching: bool) -> dict:
    async def go() -> tuple[float, list[list[dict]]]:
        async with TandemClient(d.address) as client:
            # warm up on prompts that share nothing with the conversations
            await asyncio.gather(
                *(
                    client.complete(tokens(64, 500 + i), max_tokens=4, ignore_eos=True)
                    for i in range(2)
                )
            )
            start = time.perf_counter()
            convs = await asyncio.gather(*(conversation(client, c) for c in range(CONVERSATIONS)))
            return time.perf_counter() - start, convs

    wall, convs = run(go())
    flat = [t for c in convs for t in c]
    later = [t for t in flat if t["turn"] > 1]
    per_turn = {}
    for turn in range(1, TURNS + 1):
        ts = [t for t in flat if t["turn"] == turn]
        per_turn[str(turn)] = {
            "ttft_ms_mean": ms(statistics.fmean(t["ttft_s"] for t in ts)),
            "ttft_ms_p50": ms(med([t["ttft_s"] for t in ts])),
            "client_first_chunk_ms_p50": ms(med([t["client_s"] for t in ts])),
            "prompt_tokens": ts[0]["prompt_tokens"],
            "cached_tokens": [t["cached_tokens"] for t in ts],
            "local_prefill": sum(t["local"] for t in ts),
        }
    prompt_sum = sum(t["prompt_tokens"] for t in later)
    return {
        "wall_s": round(wall, 3),
        "hit_rate_turns_2_8": round(sum(t["cached_tokens"] for t in later) / prompt_sum, 4),
        "expected_hit_rate_turns_2_8": round(
            sum(t["expected_cached"] for t in later) / prompt_sum if caching else 0.0, 4
        ),
        "ttft_ms_mean_all": ms(statistics.fmean(t["ttft_s"] for t in flat)),
        "ttft_ms_mean_turns_2_8": ms(statistics.fmean(t["ttft_s"] for t in later)),
        "completion_tokens": sum(t["completion_tokens"] for t in flat),
        "per_turn": per_turn,
    }


# -- 3. index lookup ----------------------------------------------------------------


def bench_index_lookup() -> dict:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "index_lookup.py")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-1500:]}
    full = json.loads(lines[-1])
    pick = {
        k: full[k]
        for k in (
            "blocks_indexed",
            "workers",
            "chain_len",
            "in_memory",
            "redis_index_local",
            "redis_event_to_view_ms_p50",
            "raw_redis_pipeline_128_sismember",
            "raw_redis_pipeline_128x8_sismember",
        )
        if k in full
    }
    mem = full.get("in_memory", {})
    pick["in_memory_worst_p50_ms"] = (
        round(max(v["p50_us"] for v in mem.values()) / 1e3, 4) if mem else None
    )
    return pick


def bench_prompt_hashing() -> dict:
    """The router hashes the prompt's full blocks before every lookup."""
    root = root_hash("bench", BLOCK)
    prompts = [tokens(MEASURED_TOKENS, 7000 + i) for i in range(20)]
    hash_blocks(prompts[0], BLOCK, root)
    samples = []
    for _ in range(5):
        for p in prompts:
            t = time.perf_counter_ns()
            hash_blocks(p, BLOCK, root)
            samples.append((time.perf_counter_ns() - t) / 1e3)
    return {
        "prompt_tokens": MEASURED_TOKENS,
        "blocks": MEASURED_TOKENS // BLOCK,
        "p50_us": round(med(samples), 1),
    }


# -- main ---------------------------------------------------------------------------


def main() -> None:
    import ray

    results: dict = {}
    log("index lookup (bench/index_lookup.py, 100,000 blocks) ...")
    try:
        results["index_lookup"] = bench_index_lookup()
    except Exception as e:  # keep the rest of the run
        results["index_lookup"] = {"error": repr(e)}
    results["index_lookup"]["prompt_hashing_2048_tokens"] = bench_prompt_hashing()
    log("index lookup:", json.dumps(results["index_lookup"]))

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, _node_ip_address="127.0.0.2", include_dashboard=False)
    try:
        log("deployment for TTFT (1 prefill + 1 decode) ...")
        d = Deployment(ServeConfig(engine={"kv_cache_memory_mb": KV_MB}))
        try:
            results["ttft_90pct_cached"] = bench_ttft(d)
        finally:
            d.stop()
        t = results["ttft_90pct_cached"]
        log(
            "TTFT p50 cold / warm default / warm local_prefill_tokens=0 (ms):",
            t["cold"]["ttft_ms_p50"],
            t["warm_default_routing"]["ttft_ms_p50"],
            t["warm_local_prefill_0"]["ttft_ms_p50"],
        )

        results["conversations"] = {}
        for name, caching in (("prefix_caching_on", True), ("prefix_caching_off", False)):
            log(f"conversations, {name} ...")
            engine = {"kv_cache_memory_mb": KV_MB, "enable_prefix_caching": caching}
            d = Deployment(ServeConfig(engine=engine))
            try:
                conv = bench_conversations(d, caching)
            finally:
                d.stop()
            results["conversations"][name] = conv
            log(
                f"{name}: wall {conv['wall_s']} s, hit rate {conv['hit_rate_turns_2_8']}"
                f" (expected {conv['expected_hit_rate_turns_2_8']}),"
                f" mean TTFT {conv['ttft_ms_mean_all']} ms"
            )
        on, off = (results["conversations"][k] for k in ("prefix_caching_on", "prefix_caching_off"))
        results["conversations"]["wall_off_vs_on"] = round(off["wall_s"] / on["wall_s"], 3)
        results["conversations"]["ttft_mean_off_vs_on"] = round(
            off["ttft_ms_mean_all"] / on["ttft_ms_mean_all"], 3
        )
    finally:
        ray.shutdown()

    results["targets"] = {
        "warm_vs_cold_le_0.2_default_routing": results["ttft_90pct_cached"][
            "ratio_warm_default_vs_cold"
        ]
        <= 0.2,
        "warm_vs_cold_le_0.2_local_prefill_0": results["ttft_90pct_cached"][
            "ratio_warm_local_prefill_0_vs_cold"
        ]
        <= 0.2,
        "in_memory_lookup_lt_1ms": (results["index_lookup"].get("in_memory_worst_p50_ms") or 1e9)
        < 1.0,
    }
    results["elapsed_s"] = round(time.perf_counter() - T0, 1)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
