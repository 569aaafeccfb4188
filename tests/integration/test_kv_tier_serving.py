"""The second KV tier through a served deployment: a conversation whose
blocks were evicted from its worker's pool comes back as a prefix hit from
the host tier; the router's block index says which tier held them, the
worker's stats count the hit and the bytes moved, the output equals a cold
run's, and nothing leaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import LLM
from engine.hashing import hash_blocks
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(address, prompt):
    async def run():
        async with TandemClient(address) as client:
            return await client.complete(prompt, **GREEDY)

    return asyncio.run(run())


def _until(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return result


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    # A pool of 32 blocks of the tiny model, a host tier of 64.
    config = ServeConfig(
        pools={"mode": "colocated", "decode": 1},
        engine={"kv_cache_memory_mb": 2, "kv_tier_mb": 4},
    )
    with deployed(config) as d:
        yield d


def test_an_evicted_conversation_returns_from_the_host_tier(deployment):
    index, root = deployment.backend.index, deployment.backend.routing.root
    turn1 = _tokens(100, 1)
    first = _complete(deployment.address, turn1)
    hashes = hash_blocks(turn1, BS, root)  # 6 full blocks
    for seed in range(2, 8):  # 36 more blocks through a pool of 32: turn 1's are evicted
        _complete(deployment.address, _tokens(100, seed))
    (name,) = deployment.worker_stats()
    tiers = _until(
        lambda: (t := index.lookup_tiers(hashes).get(name)) and t.host == len(hashes) and t
    )
    assert tiers and tiers.blocks == len(hashes) and tiers.device == 0  # all in the host tier

    turn2 = turn1 + first.token_ids + _tokens(20, 9)
    before = deployment.worker_stats()[name]
    out = _complete(deployment.address, turn2)
    after = deployment.worker_stats()[name]
    assert out.usage.cached_tokens == (len(turn1) + len(first.token_ids) - 1) // BS * BS
    assert after.kv_tier_hit_blocks - before.kv_tier_hit_blocks >= len(hashes)
    assert after.kv_tier_bytes_out > before.kv_tier_bytes_out
    assert 0 < after.kv_tier_blocks <= after.kv_tier_capacity_blocks == 64
    back = _until(lambda: (t := index.lookup_tiers(hashes).get(name)) and t.device and t)
    assert back and back.device == len(hashes)  # restored: on the device again

    llm = LLM(None, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    params = SamplingParams(**GREEDY)
    assert out.token_ids == llm.generate([turn2], params)[0].token_ids
    assert deployment.wait_no_leaks() == {}
