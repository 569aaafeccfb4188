"""Serving benchmark: the router against the bare engine and Hugging Face,
same run, default tiny model.

  1. TPOT through the router (disaggregated, 1 prefill + 1 decode) vs the
     bare engine's decode step, at 1 and at 64 streams of 64 prompt and
     TPOT_OUT_TOKENS output tokens (target <= 1.10x), in TPOT_ROUNDS rounds
     of a router run and a bare-engine run back to back (in turns first).
     tpot_ratio: the median over the rounds of the client's mean time per
     token while all the streams decode together, over the bare engine's
     mean decode step with as many streams in the same round (a mean over a
     mean: both hold the machine's slow steps), and the range of the rounds'
     ratios; also reported (medians over the rounds): that
     TPOT over the bare median step, the mean TPOT of the final messages (it
     mixes in the steps before every stream's KV has arrived, with fewer
     streams in the batch), and the client's median inter-token gap over
     the bare median step (itl_ratio);
  2. output tokens/s for 16 concurrent greedy requests of 256 prompt tokens
     and 64 output tokens: disaggregated (1 + 1), colocated (1 worker), and
     Hugging Face generate in static batches (target: disaggregated >= 1.5x HF);
     tandem's figures are medians of three runs.
The router runs as `tandem serve` in its own process, as in production; the
client runs here. With cpu_binding (the default) the server binds its decode
worker to a core of its own (worker/cpu_binding.py); the bare engine is then
measured bound to that same core, and the client here runs on the shared
cores, as a client on another machine would not touch the decode core.
``--no-cpu-binding`` measures everything unbound. The last line is one JSON
object with the figures.

  python bench/serving.py [--no-cpu-binding]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

# Figures in docs/benchmarks.md are of the random tiny model: keep it the default here
# (and in the `tandem serve` this starts); TANDEM_DEFAULT_MODEL=... measures another.
os.environ.setdefault("TANDEM_DEFAULT_MODEL", "tandem-tiny-llama")

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import time
from dataclasses import dataclass

import torch

from benchkit.bare_engine import decode_step_times, random_prompts
from benchkit.local_serve import tandem_serve
from engine import EngineConfig, LLMEngine
from engine.default_model import default_model_path
from router.client import TandemClient
from worker.cpu_binding import CoreLayout, available_cores, bind_process, plan_layout
from worker.heap import freeze_startup_heap

OUT_TOKENS = 64
PROMPT_TOKENS = 256
# Output tokens of a TPOT run, per stream count: long enough that the first
# stream still decodes when the last one's KV arrives (64 prefills and their
# router calls take about as long as 256 steps of a small batch), and then
# all of them decode together for a while.
TPOT_OUT_TOKENS = {1: 256, 64: 512}
ROUNDS = 3  # throughput runs of each configuration; medians are reported
# TPOT rounds (a router run and a bare run each) per stream count: a 1-stream
# round takes about a second, a 64-stream one about twenty.
TPOT_ROUNDS = {1: 15, 64: 3}


@contextlib.contextmanager
def serve(binding: bool, *flags: str):
    """`tandem serve` in a subprocess; yields its address."""
    config = (
        "engine: {kv_cache_memory_mb: 256}\nserver: {port: 0}\n"
        f"pools: {{cpu_binding: {str(binding).lower()}}}\n"
    )
    with tandem_serve(config, flags) as (address,):
        yield address


@contextlib.contextmanager
def bound(cores: tuple[int, ...] | None):
    """This process on ``cores`` (None: unchanged) for the block."""
    before = available_cores()
    if cores is not None:
        bind_process(cores)
    try:
        yield
    finally:
        if cores is not None:
            bind_process(before)


@dataclass
class StreamsRun:
    elapsed_s: float
    finals: list  # each stream's final message
    arrivals: list[list[tuple[float, int]]]  # each stream's chunks: (time, tokens)
    started: float = 0.0  # when every stream was sent (perf_counter)

    def ttfts_ms(self) -> list[float]:
        """Each stream's time to first token, as the client saw it."""
        return [(chunks[0][0] - self.started) * 1e3 for chunks in self.arrivals if chunks]

    def gaps(self) -> list[float]:
        """Every inter-token gap the client saw (a chunk of k tokens: k gaps of 1/k)."""
        out = []
        for chunks in self.arrivals:
            for (t0, _), (t1, n) in itertools.pairwise(chunks):
                out += [(t1 - t0) / n] * n
        return out

    def full_batch_tpot_s(self) -> float:
        """Mean time per token while every stream was decoding: from the last
        stream's first token to the first stream's last token. Streams join the
        decode batch as their prefills finish, so the mean TPOT of the final
        messages mixes in steps with fewer streams; this is the step time at
        the full batch, the one the bare engine's is compared with."""
        start = max(chunks[0][0] for chunks in self.arrivals)
        end = min(chunks[-1][0] for chunks in self.arrivals)
        per_stream = []
        for chunks in self.arrivals:
            tokens = sum(n for t, n in chunks if start < t <= end)
            if tokens:
                per_stream.append((end - start) / tokens)
        if not per_stream:
            raise RuntimeError("no stretch with every stream decoding: raise TPOT_OUT_TOKENS")
        return statistics.mean(per_stream)


async def run_streams(
    address: str, batch: list[list[int]], out_tokens: int = OUT_TOKENS
) -> StreamsRun:
    async def one(client: TandemClient, prompt: list[int]):
        chunks, final = [], None
        sampling = {"temperature": 0, "max_tokens": out_tokens, "ignore_eos": True}
        async for r in client.generate(prompt, **sampling):
            if r.HasField("chunk"):
                chunks.append((time.perf_counter(), len(r.chunk.token_ids)))
            else:
                final = r.final
        return final, chunks

    async with TandemClient(address) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p) for p in batch))
        elapsed = time.perf_counter() - start
    run = StreamsRun(elapsed, [f for f, _ in results], [c for _, c in results], start)
    TTFTS_MS.setdefault(len(batch), []).extend(run.ttfts_ms())
    return run


TTFTS_MS: dict[int, list[float]] = {}  # streams at once -> client TTFTs of every run


def throughput(address: str, batch: list[list[int]]) -> float:
    """Median output tokens/s over ROUNDS runs: ``batch`` first, then fresh
    prompts of the same shape (a repeated batch would hit the prefix cache)."""
    rates, cached = [], []
    for r in range(ROUNDS):
        prompts_r = batch if r == 0 else random_prompts(len(batch), PROMPT_TOKENS, seed=1000 + r)
        run = asyncio.run(run_streams(address, prompts_r))
        rates.append(len(batch) * OUT_TOKENS / run.elapsed_s)
        cached.append(sum(f.usage.cached_tokens for f in run.finals))
    print("tok/s per round", [round(x) for x in rates], "cached tokens", cached, flush=True)
    return round(statistics.median(rates), 1)


def engine_step_ms(engine: LLMEngine, streams: int, seed: int) -> tuple[float, float]:
    """Median and mean decode step of the bare engine, over the steps where all
    ``streams`` sequences decode."""
    batch = random_prompts(streams, 64, seed=seed)
    steps = decode_step_times(engine, batch, TPOT_OUT_TOKENS[streams], str(seed))
    return statistics.median(steps) * 1e3, statistics.mean(steps) * 1e3


@dataclass
class TpotRound:
    """One router run and one bare-engine run, back to back."""

    mean_tpot_ms: float  # mean TPOT of the final messages
    full_batch_tpot_ms: float
    median_itl_ms: float
    bare_median_ms: float
    bare_mean_ms: float

    @property
    def ratio(self) -> float:
        return self.full_batch_tpot_ms / self.bare_mean_ms


def measure_tpot(
    address: str,
    engine: LLMEngine,
    streams: int,
    r: int,
    client_cores: tuple[int, ...] | None,
    decode_cores: tuple[int, ...] | None,
) -> TpotRound:
    """Round ``r``: the router run and the bare run, in turns first, so that
    a machine speeding up or slowing down over the run favours neither."""
    seed = streams + 100 * r

    def router() -> StreamsRun:
        with bound(client_cores):
            batch = random_prompts(streams, 64, seed)
            return asyncio.run(run_streams(address, batch, TPOT_OUT_TOKENS[streams]))

    def bare() -> tuple[float, float]:
        with bound(decode_cores):  # the decode worker's core, the server idle
            return engine_step_ms(engine, streams, seed)

    if r % 2 == 0:
        run, (median_step, mean_step) = router(), bare()
    else:
        (median_step, mean_step), run = bare(), router()
    return TpotRound(
        mean_tpot_ms=statistics.mean(f.timings.mean_tpot_s for f in run.finals) * 1e3,
        full_batch_tpot_ms=run.full_batch_tpot_s() * 1e3,
        median_itl_ms=statistics.median(run.gaps()) * 1e3,
        bare_median_ms=median_step,
        bare_mean_ms=mean_step,
    )


def summarize_tpot(rounds: list[TpotRound]) -> dict:
    """Medians over the rounds; the ratios are medians of each round's own
    ratio (a router run over the bare run next to it: the machine's speed
    drifts by more than the overhead measured, over a run of the benchmark)."""

    def med(f) -> float:
        return statistics.median(f(x) for x in rounds)

    ratios = [x.ratio for x in rounds]
    return {
        "rounds": len(rounds),
        "router_mean_tpot_ms": round(med(lambda x: x.mean_tpot_ms), 3),
        "full_batch_tpot_ms": round(med(lambda x: x.full_batch_tpot_ms), 3),
        "client_median_itl_ms": round(med(lambda x: x.median_itl_ms), 3),
        "engine_step_ms": round(med(lambda x: x.bare_median_ms), 3),
        "engine_mean_step_ms": round(med(lambda x: x.bare_mean_ms), 3),
        # A mean over a mean: a mean TPOT holds every slow step, and so does
        # the bare engine's mean step. Medians over medians for the gaps.
        "tpot_ratio": round(statistics.median(ratios), 3),
        "tpot_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "tpot_over_median_step": round(med(lambda x: x.full_batch_tpot_ms / x.bare_median_ms), 3),
        "itl_ratio": round(med(lambda x: x.median_itl_ms / x.bare_median_ms), 3),
    }


def hf_static_tok_s(batch: list[list[int]], size: int, threads: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(default_model_path()).eval()
    config = GenerationConfig(
        max_new_tokens=OUT_TOKENS, min_new_tokens=OUT_TOKENS, do_sample=False, pad_token_id=0
    )
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(batch), size):
            model.generate(torch.tensor(batch[i : i + size]), generation_config=config)
    return len(batch) * OUT_TOKENS / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-cpu-binding", action="store_true", help="bind nothing")
    binding = not parser.parse_args().no_cpu_binding
    # What `tandem serve --decode 1` plans on this machine (one thread a worker).
    layout: CoreLayout | None = None
    if binding:
        layout = plan_layout(available_cores(), decode_workers=1, threads=1)
    decode_cores = layout.decode[0] if layout else None
    client_cores = layout.shared if layout else None
    print("cpu binding:", layout.describe() if layout else "none", flush=True)
    batch = random_prompts(16, PROMPT_TOKENS, seed=7)
    results: dict = {"cpu_binding": layout is not None}
    engine = LLMEngine(EngineConfig(num_threads=1, kv_cache_memory_bytes=256 << 20))
    # As a worker does once it has built its engine (worker/heap.py): else the
    # bare engine's steps pay full collections over this process's heap that
    # the decode worker's do not.
    freeze_startup_heap()
    with serve(binding, "--prefill", "1", "--decode", "1") as address:
        with bound(client_cores):
            asyncio.run(run_streams(address, random_prompts(2, 64, seed=99)))  # warm up
        for streams in (1, 64):
            rounds = [measure_tpot(address, engine, streams, r, client_cores, decode_cores)
                      for r in range(TPOT_ROUNDS[streams])]  # fmt: skip
            print(streams, "round ratios", [round(x.ratio, 3) for x in rounds], flush=True)
            results[f"tpot_{streams}"] = summarize_tpot(rounds)
            print(streams, results[f"tpot_{streams}"], flush=True)
        with bound(client_cores):
            results["disaggregated_tok_s"] = throughput(address, batch)
        # Client TTFT through the disaggregated router: 1 and 64 streams (the
        # TPOT rounds), 16 concurrent 256-token prompts (the throughput runs).
        results["client_ttft_ms_p50"] = {
            f"{n}_streams": round(statistics.median(v), 2)
            for n, v in sorted(TTFTS_MS.items())
            if n != 2  # the warm-up
        }
    with serve(binding, "--mode", "colocated", "--decode", "1") as address, bound(client_cores):
        asyncio.run(run_streams(address, random_prompts(2, 64, seed=99)))
        results["colocated_tok_s"] = throughput(address, batch)
    print(results, flush=True)
    results["hf_static_tok_s"] = {
        f"batch{s}_threads{t}": round(hf_static_tok_s(batch, s, t), 1)
        for s in (8, 16)
        for t in (1, 2)
    }
    hf_best = max(results["hf_static_tok_s"].values())
    results["disaggregated_vs_hf"] = round(results["disaggregated_tok_s"] / hf_best, 2)
    results["colocated_vs_hf"] = round(results["colocated_tok_s"] / hf_best, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
