"""HTTP front benchmark: the OpenAI-compatible HTTP API against the gRPC API
of the same router, same run, default tiny model.

`tandem serve --http-port 0` runs in its own process (1 prefill + 1
decode); `tandem bench`'s runner replays the same closed-loop workload
(random token-id prompts, a fresh set per run so no prefix is cached,
ignore_eos) over gRPC and over HTTP (streamed
/v1/completions), in alternating rounds so drift hits both alike. Printed:
TTFT, TPOT and ITL medians and output tokens/s per front, and HTTP / gRPC
ratios (target: within 1.10x). The last line is one JSON object.

  python bench/http_front.py [--rounds 3] [--requests 32] [--concurrency 8]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import contextlib
import json

from benchkit import metrics
from benchkit.local_serve import SERVING_LINE, tandem_serve
from benchkit.runner import LoadSpec, fetch_model_info, run_load, wait_ready
from benchkit.workload import LengthRange, synthetic_conversations


@contextlib.contextmanager
def serve():
    """`tandem serve` with the HTTP front, in a subprocess; yields (grpc, http) addresses."""
    pattern = SERVING_LINE + r", HTTP on (http://\S+:\d+)"
    with tandem_serve("", ("--port", "0", "--http-port", "0"), pattern=pattern) as targets:
        yield targets


def one_run(target: str, args: argparse.Namespace, seed: int, vocab_size: int) -> dict:
    load = LoadSpec(concurrency=args.concurrency, num_requests=args.requests, seed=seed)
    conversations = synthetic_conversations(
        LengthRange(args.input_len, args.input_len),
        LengthRange(args.output_len, args.output_len),
        vocab_size=vocab_size,
        seed=seed,
    )
    records = asyncio.run(run_load(target, conversations, load, temperature=0.0, timeout_s=300))
    summary = metrics.summarize(records, {})
    if summary["failed"]:
        raise RuntimeError(f"{target}: {summary['errors']}")
    return summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"grpc": [], "http": []}
    with serve() as (grpc_target, http_target):
        for target in (grpc_target, http_target):
            assert asyncio.run(wait_ready(target, 60)), target
        vocab = asyncio.run(fetch_model_info(grpc_target)).vocab_size
        one_run(grpc_target, args, 999, vocab)  # warm-up: the first requests build caches
        for r in range(args.rounds):
            order = [("grpc", grpc_target), ("http", http_target)]
            for name, target in order if r % 2 == 0 else order[::-1]:
                seed = 2 * r + (name == "http")  # fresh prompts: no prefix-cache hits
                runs[name].append(one_run(target, args, seed, vocab))

    def median_of(name: str, key: str) -> float:
        values = sorted(
            run[key]["p50"] if isinstance(run[key], dict) else run[key] for run in runs[name]
        )
        return values[len(values) // 2]

    figures: dict[str, dict[str, float]] = {}
    for name in runs:
        figures[name] = {
            "ttft_p50_ms": median_of(name, "ttft_s") * 1e3,
            "tpot_p50_ms": median_of(name, "tpot_s") * 1e3,
            "itl_p50_ms": median_of(name, "itl_s") * 1e3,
            "output_tok_s": median_of(name, "output_throughput"),
        }
    ratios = {k: figures["http"][k] / figures["grpc"][k] for k in figures["grpc"]}
    print(f"{'':14}{'gRPC':>12}{'HTTP':>12}{'HTTP/gRPC':>12}")
    for key, ratio in ratios.items():
        print(f"{key:14}{figures['grpc'][key]:12.1f}{figures['http'][key]:12.1f}{ratio:12.2f}")
    print(json.dumps({"bench": "http_front", "args": vars(args), **figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
