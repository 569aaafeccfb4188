"""Speculative decoding and quantized KV transfer through the router: Ray
pools, real gRPC and data channel on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 24
TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Handler:\n    def __init__(self, path):\n" * 3,
    "The quick brown fox jumps over the lazy dog. " * 12,
    "for i in range(10):\n    print(i)\n",
]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(**GREEDY)
    return [out.token_ids for out in llm.generate(TEXTS, params)]


CONFIG = ServeConfig(
    engine={"kv_cache_memory_mb": 32},
    transfer={"lease_s": 120},
    routing={"prefix_routing": False},
)


def _deployment(**sections) -> Deployment:
    return Deployment(CONFIG.updated(**sections))


async def _complete_all(address: str, prompts, **sampling):
    async with TandemClient(address) as client:
        return await asyncio.gather(*(client.complete(p, **sampling) for p in prompts))


def test_prompt_lookup_in_the_decode_pool_gives_plain_greedy_output(ray_cluster, reference):
    deployment = _deployment(speculative={"method": "ngram", "num_speculative_tokens": 4})
    try:
        outs = asyncio.run(_complete_all(deployment.address, TEXTS, **GREEDY))
        assert [o.token_ids for o in outs] == reference
        stats = deployment.worker_stats()
        decode = [s for name, s in stats.items() if name.startswith("decode")]
        prefill = [s for name, s in stats.items() if name.startswith("prefill")]
        assert sum(s.spec_proposed_tokens for s in decode) > 0
        assert sum(s.spec_accepted_tokens for s in decode) > 0
        assert all(s.spec_proposed_tokens == 0 for s in prefill)
        assert deployment.wait_no_leaks() == {}
    finally:
        deployment.stop()


def test_int8_kv_transfer_with_speculation_serves_and_frees(ray_cluster, reference):
    deployment = _deployment(transfer={"dtype": "int8"}, speculative={"method": "ngram"})
    try:
        outs = asyncio.run(_complete_all(deployment.address, TEXTS * 2, **GREEDY))
        assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
        for out, ref in zip(outs, reference * 2, strict=True):
            assert out.token_ids[0] == ref[0]  # sampled by the prefill worker
        pairs = zip(outs, reference * 2, strict=True)
        equal = sum(a == b for o, r in pairs for a, b in zip(o.token_ids, r, strict=True))
        assert equal >= 0.8 * MAX_TOKENS * len(outs)  # int8 KV barely moves greedy output
        assert deployment.wait_no_leaks() == {}
    finally:
        deployment.stop()
