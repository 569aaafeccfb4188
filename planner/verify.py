"""Replay a short Poisson load against a running `tandem serve` and measure
TTFT and TPOT client-side."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from planner.simulator import Workload, make_requests


@dataclass
class Measured:
    ttft_s: list[float]
    tpot_s: list[float]
    errors: int

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float) -> float:
        total = len(self.ttft_s) + self.errors
        if total == 0:
            return 0.0
        good = sum(
            t <= ttft_slo_s and p <= tpot_slo_s
            for t, p in zip(self.ttft_s, self.tpot_s, strict=True)
        )
        return good / total


async def _one(client, token_ids: list[int], max_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = last = None
    n = 0
    async for r in client.generate(
        token_ids, temperature=0, max_tokens=max_tokens, ignore_eos=True
    ):
        if r.HasField("chunk") and r.chunk.token_ids:
            last = time.perf_counter()
            if first is None:
                first = last
            n += len(r.chunk.token_ids)
    if first is None or last is None:
        raise RuntimeError("no tokens received")
    tpot = (last - first) / (n - 1) if n > 1 else 0.0
    return first - start, tpot


async def replay(
    target: str, workload: Workload, *, vocab_size: int, seed: int = 0, timeout_s: float = 120
) -> Measured:
    from router.client import TandemClient

    reqs = make_requests(workload, seed)
    rng = random.Random(seed + 1)
    hi = max(2, min(vocab_size, 1000))
    measured = Measured([], [], 0)
    async with TandemClient(target, timeout_s=timeout_s) as client:
        t0 = time.perf_counter()

        async def fire(r) -> None:
            await asyncio.sleep(max(0.0, r.arrival - (time.perf_counter() - t0)))
            ids = [rng.randrange(1, hi) for _ in range(r.prompt_len)]
            try:
                ttft, tpot = await _one(client, ids, r.output_len)
            except Exception:
                measured.errors += 1
                return
            measured.ttft_s.append(ttft)
            measured.tpot_s.append(tpot)

        await asyncio.gather(*(fire(r) for r in reqs))
    return measured
