"""The bare engine's decode steps, the baseline the serving benchmarks divide by."""

from __future__ import annotations

import time

import torch

from engine import LLMEngine
from protocol.sampling import SamplingParams


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn from the default model's
    vocabulary, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (length,), generator=gen).tolist() for _ in range(n)]


def decode_step_times(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str
) -> list[float]:
    """Greedy-decode ``prompts`` together to ``max_tokens`` each; the seconds
    of every step in which all of them decode (not a prefill, not the first
    token, none finished yet)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        if len(outs) == len(prompts) and all(o.num_output_tokens > 1 for o in outs):
            steps.append(time.perf_counter() - t)
    return steps
