"""Quantized weights: decode step time at 1 and 32 streams and a 512-token
prefill, float32 against int8 and q4 weights, in one run.

A fourth figure is the prefill of 16 prompts of 256 tokens added at once
(the time until each has its first token: TTFT's prefill at that shape).

The model is SmolLM2-135M-shaped with random weights (hidden 576, 30 layers, 9
heads, 3 kv heads, intermediate 1536, vocabulary 49152): the figures are about
speed, not outputs. Each setting gets its own engine (``EngineConfig.quantization``); ``--rounds``
rounds measure them in turn and keep each figure's best; the ratios are
float32's time over the setting's. The last line is one JSON
object with the figures and ratios.

With ``--model PATH`` (a .gguf file, e.g. SmolLM2's) the model's own weights
load instead, and ``as_stored`` is a setting worth timing.

  python bench/quantized.py [--threads 2] [--settings none,int8,q4] [--rounds 2]
                            [--model PATH] [--figures decode_1,prefill_512,...]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import tempfile
import time

import torch

from bench.engine import smol_dir
from engine import EngineConfig, LLMEngine
from engine.kernels import PackedWeight
from engine.quant import QuantWeight
from protocol.sampling import SamplingParams

PROMPT = 64  # tokens of each decode stream's prompt
STEPS = 16  # decode steps timed


def weight_bytes(engine: LLMEngine) -> int:
    """Bytes of the matrices a decode step reads (the embedding table excluded)."""
    model = engine.model
    mats = [m for w in model.layers for m in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]
    total = 0
    for m in mats:
        if isinstance(m, QuantWeight):
            total += m.nbytes
        else:
            t = m.panels if isinstance(m, PackedWeight) else m
            total += t.numel() * t.element_size()
    return total


def decode_step_ms(engine: LLMEngine, streams: int, seed: int) -> float:
    """Median time of a decode-only step with ``streams`` sequences running."""
    vocab = engine.spec.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=STEPS + 2, ignore_eos=True)
    for i in range(streams):
        prompt = torch.randint(10, vocab, (PROMPT,), generator=gen).tolist()
        engine.add_request(f"d{seed}-{i}", prompt, params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed < PROMPT for s in scheduler.running):
        engine.step()  # the prefills
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[:STEPS]) * 1e3


def prefill_ms(engine: LLMEngine, tokens: int = 512, seed: int = 0) -> float:
    """The better of two prefills of a ``tokens``-token prompt (no cache hits)."""
    vocab = engine.spec.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for rep in range(2):
        gen = torch.Generator().manual_seed(100 + rep)
        engine.add_request(
            f"p{rep}", torch.randint(10, vocab, (tokens,), generator=gen).tolist(), one
        )
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def batch_prefill_ms(
    engine: LLMEngine, streams: int = 16, tokens: int = 256, seed: int = 0
) -> float:
    """Time until each of ``streams`` prompts of ``tokens`` tokens, added at once,
    has its first token (the prefill part of TTFT at that shape)."""
    vocab = engine.spec.vocab_size
    gen = torch.Generator().manual_seed(200 + seed)
    one = SamplingParams(temperature=0, max_tokens=1)
    for i in range(streams):
        prompt = torch.randint(10, vocab, (tokens,), generator=gen).tolist()
        engine.add_request(f"b{seed}-{i}", prompt, one)
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - t) * 1e3


# Each figure by name: (engine, round) -> milliseconds.
FIGURES = {
    "decode_1": lambda engine, r: decode_step_ms(engine, 1, seed=10 * r + 1),
    "decode_32": lambda engine, r: decode_step_ms(engine, 32, seed=10 * r + 2),
    "prefill_512": lambda engine, r: prefill_ms(engine, seed=10 * r),
    "prefill_16x256": lambda engine, r: batch_prefill_ms(engine, seed=r),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default="none,int8,q4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="a checkpoint or .gguf file's weights")
    parser.add_argument(
        "--figures", default=",".join(FIGURES), help="which of the figures to time, by name"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = args.settings.split(",")
    label = args.model or "smollm2-135m-shaped, random weights"
    results: dict = {"threads": args.threads, "model": label}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or smol_dir(Path(tmp) / "smol")
        engines = {
            setting: LLMEngine(
                EngineConfig(
                    model=str(path),
                    load_format="auto" if args.model else "dummy",
                    quantization=setting,
                    kv_cache_memory_bytes=256 << 20,
                    max_num_batched_tokens=2048,
                    enable_prefix_caching=False,  # every prefill computed in full
                )
            )
            for setting in settings
        }
        # Rounds over the settings in turn, the best of each figure kept: a busy
        # neighbour or a cold first pass then slows every setting alike.
        for round_ in range(args.rounds):
            for setting, engine in engines.items():
                figures = {
                    f"{name}_ms": FIGURES[name](engine, round_) for name in args.figures.split(",")
                }
                best = results.setdefault(setting, {})
                for key, value in figures.items():
                    best[key] = round(min(best.get(key, value), value), 3)
                best["weight_mb"] = round(weight_bytes(engine) / 1e6, 1)
                best["kernels"] = engine.model.kernels is not None
                print(f"round {round_}", setting, json.dumps(figures), flush=True)
        del engines
    if "none" in results:
        base = results["none"]
        for setting in settings:
            if setting == "none":
                continue
            for key in (f"{name}_ms" for name in args.figures.split(",")):
                name = f"{setting}_{key.removesuffix('_ms')}_vs_fp32"
                results[name] = round(base[key] / results[setting][key], 2)
                print(f"{name}: {results[name]}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
