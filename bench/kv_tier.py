"""The second KV tier on returning conversations (engine/kv_tier.py): a
multi-turn workload (benchkit/kv_tier_workload.py) played on

- big:        a pool 8x the small one, holding every prefix (the reference),
- small:      the small pool alone (evicted prefixes are recomputed),
- small+tier: the small pool with a tier as large as the big pool.

Prints the cached prompt tokens of returning turns and their median time to
first token for each, then the last line, a JSON object with
``tier_hit_ratio`` (cached tokens of returning turns with small+tier over
those with big), the TTFT ratio of small over small+tier, and
``deterministic_cost`` (throughput without deterministic mode over with it,
docs/deterministic.md).

  python bench/kv_tier.py [--model DIR] [--conversations 16] [--turns 3]
                          [--first-tokens 400] [--small-blocks 64]
                          [--parts tier,deterministic] [--quantization auto]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import dataclasses
import json
import statistics
import tempfile
import time

from benchkit.kv_tier_workload import Played, Workload, play
from engine import EngineConfig, LLMEngine
from protocol.sampling import SamplingParams


def _run(args, workload: Workload, blocks: int, tier_blocks: int | None, tmp: str):
    config = EngineConfig(
        model=args.model, num_kv_blocks=blocks, kv_tier_num_blocks=tier_blocks,
        kv_tier_dir=tmp, num_threads=args.threads,
    )  # fmt: skip
    engine = LLMEngine(config)
    play(engine, dataclasses.replace(workload, seed=workload.seed + 1))  # warm up, other chats
    engine.block_pool.allocate(hold := _filler(), engine.block_pool.num_free)  # empty the cache
    engine.block_pool.release(hold)
    if engine.kv_tier is not None:
        engine.close()
        engine.kv_tier = engine._make_tier(config)  # an empty tier, as at a start
    played = play(engine, workload)
    stats = dataclasses.asdict(engine.kv_tier.stats) if engine.kv_tier is not None else None
    return played, stats


def _filler():
    from engine.block_pool import Holder

    return Holder("scratch", "bench-empty-cache")


def _row(name: str, played: Played) -> dict:
    ttft = played.returning_ttft_s()
    row = {
        "returning_cached_tokens": played.cached_tokens(returning_only=True),
        "returning_ttft_ms_median": round(1e3 * statistics.median(ttft), 3),
        "returning_ttft_ms_mean": round(1e3 * statistics.fmean(ttft), 3),
    }
    print(
        f"{name:11s} returning turns: {row['returning_cached_tokens']:6d} cached tokens, "
        f"TTFT median {row['returning_ttft_ms_median']:8.2f} ms, "
        f"mean {row['returning_ttft_ms_mean']:8.2f} ms",
        flush=True,
    )
    return row


def deterministic_cost(args) -> dict:
    """Throughput without deterministic mode over with it: 16 requests of 64
    prompt and 32 output tokens (greedy) on one engine, the second of two
    rounds (the first warms it up), for each mode in turn."""
    rates = {}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for mode in (False, True):
        config = EngineConfig(model=args.model, num_threads=args.threads,
                              quantization=args.quantization, deterministic=mode)  # fmt: skip
        engine = LLMEngine(config)
        for round_ in range(2):
            for i in range(16):
                prompt = [10 + (7 * i + 31 * round_ + j) % 4000 for j in range(64)]
                engine.add_request(f"d{round_}-{i}", prompt, params)
            start, tokens = time.perf_counter(), 0
            while engine.has_unfinished():
                tokens += sum(len(o.new_token_ids) for o in engine.step())
            rates[mode] = tokens / (time.perf_counter() - start)
        print(f"deterministic={mode}: {rates[mode]:.1f} output tokens/s", flush=True)
    return {
        "deterministic_cost": round(rates[False] / rates[True], 4),
        "deterministic_quantization": args.quantization,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: embedded)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-tokens", type=int, default=400)
    ap.add_argument("--user-tokens", type=int, default=40)
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--small-blocks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default="auto", help="weights of the deterministic_cost run")
    ap.add_argument("--parts", default="tier,deterministic", help="tier, deterministic or both")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"tier", "deterministic"}:
        ap.error(f"--parts: {args.parts!r} (tier, deterministic or both)")
    if parts == {"deterministic"}:
        print(json.dumps(deterministic_cost(args)))
        return
    workload = Workload(args.conversations, args.turns, args.first_tokens, args.user_tokens,
                        args.output_tokens)  # fmt: skip
    small, big = args.small_blocks, 8 * args.small_blocks
    rows, tier_stats = {}, None
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as tmp:
        for name, blocks, tier in (("big", big, None), ("small", small, None),
                                   ("small+tier", small, big)):  # fmt: skip
            played, stats = _run(args, workload, blocks, tier, tmp)
            rows[name] = (played, _row(name, played))
            tier_stats = stats or tier_stats
    ref, tiered, alone = rows["big"][0], rows["small+tier"][0], rows["small"][0]
    assert tiered.outputs() == ref.outputs() == alone.outputs(), "outputs differ"
    hits = {name: row["returning_cached_tokens"] for name, (_, row) in rows.items()}
    ttft = {name: row["returning_ttft_ms_median"] for name, (_, row) in rows.items()}
    result = {
        "tier_hit_ratio": round(hits["small+tier"] / max(1, hits["big"]), 4),
        "small_hit_ratio": round(hits["small"] / max(1, hits["big"]), 4),
        "returning_ttft_ms_median": ttft,
        "ttft_small_over_small_tier": round(ttft["small"] / ttft["small+tier"], 3),
        "ttft_small_tier_over_big": round(ttft["small+tier"] / ttft["big"], 3),
        "tier": tier_stats,
        "workload": dataclasses.asdict(workload),
        "pool_blocks": {"small": small, "big": big, "tier": big},
        **(deterministic_cost(args) if "deterministic" in parts else {}),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
