"""Serving benchmark: the router against the bare engine and Hugging Face,
same run, default tiny model.

  1. TPOT through the router (disaggregated, 1 prefill + 1 decode) vs the
     bare engine's decode step, at 1 and at 64 streams (target <= 1.10x);
  2. output tokens/s for 16 concurrent greedy requests of 256 prompt tokens
     and 64 output tokens: disaggregated (1 + 1), colocated (1 worker), and
     Hugging Face generate in static batches (target: disaggregated >= 1.5x HF).
The last line is one JSON object with the figures.

  python bench/serving.py
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
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.default_model import default_model_path
from router.client import TandemClient
from tandem_cli.config import ServeConfig
from tandem_cli.deployment import Deployment

OUT_TOKENS = 64
PROMPT_TOKENS = 256


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (length,), generator=gen).tolist() for _ in range(n)]


def engine_step_ms(streams: int) -> float:
    """Median decode step of the bare engine with ``streams`` sequences decoding."""
    engine = LLMEngine(EngineConfig(num_threads=1, kv_cache_memory_bytes=256 << 20))
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts(streams, 64, seed=streams)):
        engine.add_request(str(i), p, params)
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if len(outs) == streams and all(o.num_output_tokens > 1 for o in outs):
            steps.append(time.perf_counter() - t)
    return statistics.median(steps) * 1e3


async def router_run(address: str, batch: list[list[int]]) -> tuple[float, list]:
    async with TandemClient(address) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(
                client.complete(p, temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
                for p in batch
            )
        )
        return time.perf_counter() - start, outs


def router_tpot_ms(address: str, streams: int) -> float:
    asyncio.run(router_run(address, prompts(2, 64, seed=99)))  # warm up
    _, outs = asyncio.run(router_run(address, prompts(streams, 64, seed=streams)))
    return statistics.mean(o.timings.mean_tpot_s for o in outs) * 1e3


def hf_static_tok_s(batch: list[list[int]], size: int) -> float:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(2)
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
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=4, _node_ip_address="127.0.0.2", include_dashboard=False)
    batch = prompts(16, PROMPT_TOKENS, seed=7)
    results: dict = {}
    try:
        disagg = Deployment(ServeConfig(prefill=1, decode=1, kv_cache_memory_mb=256))
        try:
            for streams in (1, 64):
                router = router_tpot_ms(disagg.address, streams)
                bare = engine_step_ms(streams)
                results[f"tpot_{streams}"] = {
                    "router_ms": round(router, 3),
                    "engine_step_ms": round(bare, 3),
                    "ratio": round(router / bare, 3),
                }
                print(streams, results[f"tpot_{streams}"], flush=True)
            elapsed, _ = asyncio.run(router_run(disagg.address, batch))
            results["disaggregated_tok_s"] = round(16 * OUT_TOKENS / elapsed, 1)
        finally:
            disagg.stop()
        colocated = Deployment(ServeConfig(mode="colocated", decode=1, kv_cache_memory_mb=256))
        try:
            asyncio.run(router_run(colocated.address, prompts(2, 64, seed=99)))
            elapsed, _ = asyncio.run(router_run(colocated.address, batch))
            results["colocated_tok_s"] = round(16 * OUT_TOKENS / elapsed, 1)
        finally:
            colocated.stop()
    finally:
        ray.shutdown()
    results["hf_static_tok_s"] = {str(s): round(hf_static_tok_s(batch, s), 1) for s in (8, 16)}
    hf_best = max(results["hf_static_tok_s"].values())
    results["disaggregated_vs_hf"] = round(results["disaggregated_tok_s"] / hf_best, 2)
    results["colocated_vs_hf"] = round(results["colocated_tok_s"] / hf_best, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
