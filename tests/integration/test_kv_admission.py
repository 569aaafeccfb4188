"""Requests wait for KV room instead of failing: a decode pool far too small
for the load serves all of it, with outputs equal to the engine alone, no
running sequence preempted (by a push or otherwise), and every block back
at the end; the admission queue starts higher priorities first."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed
from tests.integration.worker_kills import freeze

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 16
TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Handler:\n    def __init__(self, path):\n",
    "x",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    print(i)\n",
]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
# 1 MiB of KV: 16 blocks of 16 tokens for the default model, room for about
# four of these requests per decode worker at a time.
TINY = ServeConfig(
    engine={"kv_cache_memory_mb": 1},
    limits={"max_queued_requests": 256},
    transfer={"lease_s": 120},
)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(**GREEDY)
    return {t: out.token_ids for t, out in zip(TEXTS, llm.generate(TEXTS, params), strict=True)}


@pytest.fixture(scope="module")
def disagg(ray_cluster):
    # One deployment for both cases of the 64-request test: each sets the
    # router's prefix routing (PrefixRouter.enabled) itself.
    config = TINY.updated(pools={"prefill": 1, "decode": 2}, routing={"prefix_routing": True})
    with deployed(config) as d:
        yield d


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    with deployed(TINY.updated(pools={"mode": "colocated", "decode": 1})) as d:
        yield d


def _decode_stats(deployment):
    return {n: s for n, s in deployment.worker_stats().items() if not n.startswith("prefill")}


# Prefix routing off, then on: repeated prompts meet their prefix cached on a
# decode worker, which the router must not count as room twice.
@pytest.mark.parametrize("prefix_routing", [False, True], ids=["disagg", "disagg_prefix"])
def test_64_requests_on_a_full_pool_all_complete_without_preemption(
    disagg, prefix_routing, reference
):
    disagg.backend.routing.enabled = prefix_routing
    before = _decode_stats(disagg)
    queued = disagg.backend.admission.num_queued
    assert all(s.total_blocks <= 16 for s in before.values())
    prompts = [TEXTS[i % len(TEXTS)] for i in range(64)]

    async def run():
        async with TandemClient(disagg.address) as client:
            return await asyncio.gather(*(client.complete(p, **GREEDY) for p in prompts))

    try:
        outs = asyncio.run(run())  # any failure (UNAVAILABLE, RESOURCE_EXHAUSTED) raises here
    finally:
        disagg.backend.routing.enabled = True
    assert [o.token_ids for o in outs] == [reference[p] for p in prompts]
    assert disagg.backend.admission.num_queued > queued  # the pool was full: requests waited
    after = _decode_stats(disagg)
    for name, stats in after.items():
        assert stats.num_preemptions == before[name].num_preemptions, name
        assert stats.num_push_preemptions == 0, name
    assert disagg.backend.failover.retries == 0
    assert disagg.wait_no_leaks() == {}


async def _until(what: str, ready, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


def test_higher_priority_starts_before_earlier_lower_ones(colocated):
    # Each request holds 10 of the 16 blocks at its longest: one at a time.
    long = {"temperature": 0, "max_tokens": 140, "ignore_eos": True}
    finished: list[str] = []

    async def one(client, name, prompt, **sampling):
        await client.complete(prompt, **sampling)
        finished.append(name)

    async def run():
        worker = colocated.backend.decode.workers[0]
        queue = colocated.backend.admission.queue
        rooms = colocated.backend.admission.rooms
        # The worker's room came with its stream: the filler's blocks are promised.
        assert rooms.total(worker.name) is not None
        async with TandemClient(colocated.address) as client:
            tasks = [asyncio.ensure_future(one(client, "filler", "x y z", **long))]
            await _until("the filler runs", lambda: worker.in_flight == 1)
            # The worker stands still (SIGSTOP) while the others queue, so the
            # filler cannot end first however slowly they arrive; admission is
            # the router's, so it queues them all the same.
            pid = freeze(worker)
            try:
                for i, (name, prio) in enumerate([("low1", 0), ("low2", 0), ("high", 7)]):
                    task = one(client, name, "a b c", priority=prio, **long)
                    tasks.append(asyncio.ensure_future(task))
                    await _until(f"{name} waits", lambda n=i + 1: len(queue) == n)
            finally:
                os.kill(pid, signal.SIGCONT)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    assert finished == ["filler", "high", "low1", "low2"]
    stats = _decode_stats(colocated)
    assert all(s.num_preemptions == 0 for s in stats.values())
    assert colocated.wait_no_leaks() == {}
