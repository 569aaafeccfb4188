"""Prefix caching across pools, end to end through the router.

A request that shares most of its prompt with an earlier one is routed to
the workers holding that prefix, computes only the rest, reports the cached
tokens in its usage, and gives the same greedy output as a cold run. Turn 2
of a conversation reuses the decode worker's blocks of turn 1 (prompt and
answer). With the index in Redis, restarting Redis fails no request.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


def _tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llm():
    return LLM(None, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)


def _reference(llm, prompt, max_tokens=16):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([prompt], params)[0].token_ids


def _complete(address, prompt, **sampling):
    async def run():
        async with TandemClient(address) as client:
            return await client.complete(prompt, **sampling)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    # local_prefill_tokens=0: every prompt goes through the prefill pool, so the
    # prefill side's reuse and the decode side's "only the blocks it lacks" show.
    # A long lease: pinned and pushed blocks must come back through the request's
    # own paths, not the lease.
    config = ServeConfig(
        pools={"prefill": 2, "decode": 2},
        engine={"kv_cache_memory_mb": 32},
        routing={"local_prefill_tokens": 0},
        transfer={"lease_s": 120},
    )
    with deployed(config) as d:
        yield d


def test_shared_prefix_is_cached_and_output_unchanged(deployment, llm):
    shared = _tokens(576, 1)  # 36 blocks: 90% of the 640-token prompts below
    first = _complete(deployment.address, shared + _tokens(64, 2), **GREEDY)
    assert first.usage.cached_tokens == 0
    prompt = shared + _tokens(64, 3)
    second = _complete(deployment.address, prompt, **GREEDY)
    assert second.usage.cached_tokens >= 0.9 * len(prompt)
    assert second.timings.prefill_worker == first.timings.prefill_worker  # routed to the prefix
    assert second.token_ids == _reference(llm, prompt)  # same as a cold run
    # Ending on its first token: the prefix pinned on the decode worker is let go.
    one = _complete(deployment.address, shared + _tokens(64, 4), temperature=0, max_tokens=1)
    assert one.finish_reason == "length" and len(one.token_ids) == 1
    assert deployment.wait_no_leaks() == {}


def test_decode_receives_only_the_blocks_it_lacks(deployment, llm):
    def pushed() -> int:
        return sum(s.kv_bytes_pushed for s in deployment.worker_stats().values())

    shared = _tokens(320, 4)  # 20 blocks
    before = pushed()
    _complete(deployment.address, shared + _tokens(40, 5), **GREEDY)
    cold_bytes = pushed() - before  # 23 blocks: 22 full and a partial one
    prompt = shared + _tokens(40, 6)
    before = pushed()
    out = _complete(deployment.address, prompt, **GREEDY)
    warm_bytes = pushed() - before  # only the 3 blocks past the shared prefix
    assert out.token_ids == _reference(llm, prompt)
    assert 0 < warm_bytes < cold_bytes * 4 / 23


def test_multi_turn_reuses_the_decode_side_blocks(ray_cluster, llm):
    d = Deployment(ServeConfig(engine={"kv_cache_memory_mb": 32}))
    try:
        turn1 = _tokens(100, 7)
        answer = _complete(d.address, turn1, temperature=0, max_tokens=40, ignore_eos=True)
        turn2 = turn1 + answer.token_ids + _tokens(20, 8)
        out = _complete(d.address, turn2, **GREEDY)
        # The decode worker holds turn 1's prompt and answer blocks (all but the
        # last answer token's KV) and prefills only the new tail itself.
        assert out.usage.cached_tokens == (len(turn1) + 40 - 1) // BS * BS
        assert out.timings.prefill_worker == out.timings.decode_worker
        assert out.token_ids == _reference(llm, turn2)
        assert d.wait_no_leaks() == {}
    finally:
        d.stop()


def test_redis_restart_during_load_fails_no_request(ray_cluster, llm):
    with RedisServer() as redis:
        d = Deployment(
            ServeConfig(engine={"kv_cache_memory_mb": 32}, routing={"redis_url": redis.url})
        )
        try:
            shared = _tokens(160, 9)
            prompts = [shared + _tokens(24, 100 + i) for i in range(24)]

            async def load():
                async with TandemClient(d.address) as client:
                    results = []
                    for i in range(0, len(prompts), 4):
                        batch = prompts[i : i + 4]
                        results += await asyncio.gather(
                            *(client.complete(p, **GREEDY) for p in batch)
                        )
                    return results

            restarter = threading.Timer(1.0, redis.restart)
            restarter.start()
            outs = asyncio.run(load())
            restarter.join()
            assert [o.token_ids for o in outs] == [_reference(llm, p) for p in prompts]
            # After the restart the index rebuilds itself and routing by prefix resumes.
            deadline = time.monotonic() + 30
            while not d.backend.index.healthy and time.monotonic() < deadline:
                time.sleep(0.2)
            assert d.backend.index.healthy
            again = _complete(d.address, prompts[0], **GREEDY)
            assert again.usage.cached_tokens >= len(shared) // BS * BS
            assert d.wait_no_leaks() == {}
        finally:
            d.stop()


def test_prefix_on_a_busy_worker_is_pulled_not_recomputed(deployment, llm):
    shared = _tokens(480, 10)  # 30 blocks
    first = _complete(deployment.address, shared + _tokens(30, 11), **GREEDY)
    backend = deployment.backend
    holder = next(w for w in backend.prefill.workers if w.name == first.timings.prefill_worker)
    holder.in_flight += 1000  # looks overloaded: routing must pick the other worker
    try:
        prompt = shared + _tokens(30, 12)
        out = _complete(deployment.address, prompt, **GREEDY)
    finally:
        holder.in_flight -= 1000
    assert out.timings.prefill_worker != holder.name
    assert out.usage.cached_tokens >= len(shared)  # pulled blocks count as cached
    assert out.token_ids == _reference(llm, prompt)
    pulled = deployment.worker_stats()[out.timings.prefill_worker].kv_bytes_pulled
    assert pulled > 0
    assert deployment.wait_no_leaks() == {}
