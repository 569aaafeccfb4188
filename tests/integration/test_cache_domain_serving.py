"""Prefix-cache domains end to end: a request of one domain never gets
``cached_tokens`` for another domain's prompt, while a domain still hits its
own cache; outputs stay those of a cold run and no block leaks.
"""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

KEY_A, KEY_B = "sk-domain-a", "sk-domain-b"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def _tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(10, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(address: str, key: str, prompt: list[int], **fields):
    async def run():
        async with TandemClient(address, api_key=key) as client:
            return await client.complete(prompt, **GREEDY, **fields)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False)
    greedy = SamplingParams(**GREEDY)
    return lambda prompt: llm.generate([prompt], greedy)[0].token_ids


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = ServeConfig(
        engine={"kv_cache_memory_mb": 32},
        routing={"local_prefill_tokens": 0},
        security={"api_keys": [KEY_A, KEY_B], "cache_domain": "per_api_key"},
    )
    with deployed(config) as d:
        yield d


def test_a_key_never_hits_another_keys_prompt(deployment, reference):
    prompt = _tokens(256, 11)  # 16 blocks
    a1 = _complete(deployment.address, KEY_A, prompt)
    a2 = _complete(deployment.address, KEY_A, prompt)
    b1 = _complete(deployment.address, KEY_B, prompt)
    b2 = _complete(deployment.address, KEY_B, prompt)
    assert a1.usage.cached_tokens == 0
    assert a2.usage.cached_tokens > 0  # a domain hits its own cache
    assert b1.usage.cached_tokens == 0  # but never another's
    assert b2.usage.cached_tokens > 0
    for out in (a1, a2, b1, b2):
        assert out.token_ids == reference(prompt)
    assert deployment.wait_no_leaks() == {}


def test_a_cache_salt_is_a_domain_within_a_key(deployment, reference):
    prompt = _tokens(256, 12)
    plain = _complete(deployment.address, KEY_A, prompt)
    salted = _complete(deployment.address, KEY_A, prompt, cache_salt="team-1")
    other_key = _complete(deployment.address, KEY_B, prompt, cache_salt="team-1")
    again = _complete(deployment.address, KEY_A, prompt, cache_salt="team-1")
    assert plain.usage.cached_tokens == 0
    assert salted.usage.cached_tokens == 0
    assert other_key.usage.cached_tokens == 0  # the same salt under another key
    assert again.usage.cached_tokens > 0
    for out in (plain, salted, other_key, again):
        assert out.token_ids == reference(prompt)
    assert deployment.wait_no_leaks() == {}
