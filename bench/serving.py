"""Serving benchmark: the router against the bare engine and Hugging Face,
same run, default tiny model.

  1. TPOT through the router (disaggregated, 1 prefill + 1 decode) vs the
     bare engine's decode step, at 1 and at 64 streams (target <= 1.10x);
     medians of ROUNDS router runs alternating with ROUNDS bare-engine runs.
     Reported both as the mean TPOT of the final messages (it includes the
     steps slowed by other requests' prefill and KV arrival) and as the
     median inter-token latency seen by the client;
  2. output tokens/s for 16 concurrent greedy requests of 256 prompt tokens
     and 64 output tokens: disaggregated (1 + 1), colocated (1 worker), and
     Hugging Face generate in static batches (target: disaggregated >= 1.5x HF);
     tandem's figures are medians of three runs.
The router runs as `tandem serve` in its own process, as in production; the
client runs here. The last line is one JSON object with the figures.

  python bench/serving.py
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import asyncio
import contextlib
import json
import statistics
import time

import torch

from benchkit.local_serve import tandem_serve
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model import default_model_path
from router.client import TandemClient

OUT_TOKENS = 64
PROMPT_TOKENS = 256
ROUNDS = 3  # runs of each measurement; medians are reported


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (length,), generator=gen).tolist() for _ in range(n)]


@contextlib.contextmanager
def serve(*flags: str):
    """`tandem serve` in a subprocess; yields its address."""
    with tandem_serve("kv_cache_memory_mb: 256\nport: 0\n", flags) as (address,):
        yield address


async def run_streams(address: str, batch: list[list[int]]) -> tuple[float, list, list[float]]:
    """Wall time, final messages, and every inter-token gap seen by the client."""
    gaps: list[float] = []

    async def one(client: TandemClient, prompt: list[int]):
        last, final = None, None
        sampling = {"temperature": 0, "max_tokens": OUT_TOKENS, "ignore_eos": True}
        async for r in client.generate(prompt, **sampling):
            now = time.perf_counter()
            if r.HasField("chunk"):
                if last is not None:
                    gaps.extend([(now - last) / len(r.chunk.token_ids)] * len(r.chunk.token_ids))
                last = now
            else:
                final = r.final
        return final

    async with TandemClient(address) as client:
        start = time.perf_counter()
        finals = await asyncio.gather(*(one(client, p) for p in batch))
        return time.perf_counter() - start, finals, gaps


def throughput(address: str, batch: list[list[int]]) -> float:
    """Median output tokens/s over ROUNDS runs: ``batch`` first, then fresh
    prompts of the same shape (a repeated batch would hit the prefix cache)."""
    rates, cached = [], []
    for r in range(ROUNDS):
        prompts_r = batch if r == 0 else prompts(len(batch), PROMPT_TOKENS, seed=1000 + r)
        elapsed, finals, _ = asyncio.run(run_streams(address, prompts_r))
        rates.append(len(batch) * OUT_TOKENS / elapsed)
        cached.append(sum(f.usage.cached_tokens for f in finals))
    print("tok/s per round", [round(x) for x in rates], "cached tokens", cached, flush=True)
    return round(statistics.median(rates), 1)


def engine_step_ms(engine: LLMEngine, streams: int, seed: int) -> float:
    """Median decode step of the bare engine with ``streams`` sequences decoding."""
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts(streams, 64, seed=seed)):
        engine.add_request(f"{seed}-{i}", p, params)
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if len(outs) == streams and all(o.num_output_tokens > 1 for o in outs):
            steps.append(time.perf_counter() - t)
    return statistics.median(steps) * 1e3


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
    batch = prompts(16, PROMPT_TOKENS, seed=7)
    results: dict = {}
    engine = LLMEngine(EngineConfig(num_threads=1, kv_cache_memory_bytes=256 << 20))
    with serve("--prefill", "1", "--decode", "1") as address:
        asyncio.run(run_streams(address, prompts(2, 64, seed=99)))  # warm up
        for streams in (1, 64):
            # Router runs and bare-engine runs alternate, ROUNDS of each, so a
            # burst of load on the shared machine does not land on one side only.
            tpots, itls, bares = [], [], []
            for r in range(ROUNDS):
                seed = streams + 100 * r
                _, finals, gaps = asyncio.run(run_streams(address, prompts(streams, 64, seed)))
                tpots.append(statistics.mean(f.timings.mean_tpot_s for f in finals) * 1e3)
                itls.append(statistics.median(gaps) * 1e3)
                bares.append(engine_step_ms(engine, streams, seed))
            tpot, itl, bare = (statistics.median(x) for x in (tpots, itls, bares))
            results[f"tpot_{streams}"] = {
                "router_mean_tpot_ms": round(tpot, 3),
                "client_median_itl_ms": round(itl, 3),
                "engine_step_ms": round(bare, 3),
                "tpot_ratio": round(tpot / bare, 3),
                "itl_ratio": round(itl / bare, 3),
            }
            print(streams, results[f"tpot_{streams}"], flush=True)
        results["disaggregated_tok_s"] = throughput(address, batch)
    with serve("--mode", "colocated", "--decode", "1") as address:
        asyncio.run(run_streams(address, prompts(2, 64, seed=99)))
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
