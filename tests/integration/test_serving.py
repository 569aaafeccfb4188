"""End to end through the router: Ray pools, real gRPC on 127.0.0.1.

Greedy output through the router equals the engine alone, in the
disaggregated and the colocated mode; every worker's free block count
returns to its starting value after finished, cancelled and failed
requests.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 24
TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Handler:\n    def __init__(self, path):\n" * 3,
    "x",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "for i in range(10):\n    print(i)\n",
]


# A long lease: blocks must come back through the abort paths, not the lease.
CONFIG = ServeConfig(
    engine={"kv_cache_memory_mb": 32},
    limits={"max_queued_requests": 128},
    transfer={"lease_s": 120},
)


@pytest.fixture(scope="module")
def reference():
    """The engine alone: greedy outputs for TEXTS."""
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {t: out for t, out in zip(TEXTS, llm.generate(TEXTS, params), strict=True)}


@pytest.fixture(scope="module")
def disagg(ray_cluster):
    # Plain disaggregation: every request prefilled on the prefill pool
    # (KV-aware routing and local prefill have their own tests).
    config = CONFIG.updated(pools={"prefill": 2, "decode": 2}, routing={"prefix_routing": False})
    with deployed(config) as d:
        yield d


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    with deployed(CONFIG.updated(pools={"mode": "colocated", "decode": 1})) as d:
        yield d


async def _complete_all(address: str, prompts, **sampling):
    async with TandemClient(address) as client:
        return await asyncio.gather(*(client.complete(p, **sampling) for p in prompts))


GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_greedy_through_router_equals_engine(request, mode, reference):
    deployment = request.getfixturevalue(mode)
    outs = asyncio.run(_complete_all(deployment.address, TEXTS, **GREEDY))
    one = asyncio.run(_complete_all(deployment.address, TEXTS[:1], temperature=0, max_tokens=1))
    assert one[0].token_ids == reference[TEXTS[0]].token_ids[:1]  # ended by its first token
    for text, out in zip(TEXTS, outs, strict=True):
        assert out.token_ids == reference[text].token_ids
        assert out.text == reference[text].text
        assert out.finish_reason == "length"
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.usage.prompt_tokens == len(reference[text].prompt_token_ids)
        assert out.timings.ttft_s > 0
    assert deployment.wait_no_leaks() == {}


def test_64_concurrent_requests_on_two_by_two(disagg, reference):
    prompts = [TEXTS[i % len(TEXTS)] for i in range(64)]
    outs = asyncio.run(_complete_all(disagg.address, prompts, **GREEDY))
    assert [o.token_ids for o in outs] == [reference[p].token_ids for p in prompts]
    used = {(o.timings.prefill_worker, o.timings.decode_worker) for o in outs}
    assert len({p for p, _ in used}) == 2  # both prefill workers served
    assert len({d for _, d in used}) == 2  # and both decode workers
    assert disagg.wait_no_leaks() == {}


def test_stream_order_chunks_then_final(disagg):
    async def run():
        async with TandemClient(disagg.address) as client:
            return [r async for r in client.generate(TEXTS[0], **GREEDY)]

    responses = asyncio.run(run())
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "final" and set(kinds[:-1]) == {"chunk"}
    assert sum(len(r.chunk.token_ids) for r in responses[:-1]) == MAX_TOKENS
    assert responses[0].chunk.token_ids  # the first token arrives on its own, first


def test_cancel_mid_stream_frees_blocks(disagg):
    async def run():
        async with TandemClient(disagg.address) as client:
            got = 0
            async for r in client.generate(TEXTS[1], temperature=0, max_tokens=500):
                got += len(r.chunk.token_ids)
                if got >= 3:
                    break  # leaving the loop cancels the call
            return got

    assert asyncio.run(run()) >= 3
    assert disagg.wait_no_leaks() == {}


@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.2])
def test_cancel_during_prefill_frees_blocks(disagg, delay_s):
    prompt = list(range(100, 1900))  # a long prompt: cancelled during prefill or transfer

    async def run():
        async with TandemClient(disagg.address) as client:
            task = asyncio.ensure_future(client.complete(prompt, temperature=0, max_tokens=8))
            await asyncio.sleep(delay_s)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    asyncio.run(run())
    assert disagg.wait_no_leaks(timeout_s=60) == {}


def test_deadline_exceeded_frees_blocks(disagg):
    async def run():
        async with TandemClient(disagg.address, timeout_s=0.3) as client:
            await client.complete(TEXTS[3], temperature=0, max_tokens=1000, ignore_eos=True)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert disagg.wait_no_leaks() == {}


def test_admission_limit_rejects_at_once(disagg):
    service = disagg.server.service
    service.max_queued_requests = 4

    async def run():
        async with TandemClient(disagg.address) as client:
            calls = [
                client.complete(TEXTS[0], temperature=0, max_tokens=64, ignore_eos=True)
                for _ in range(12)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    try:
        results = asyncio.run(run())
    finally:
        service.max_queued_requests = disagg.config.limits.max_queued_requests
    rejected = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert rejected and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in rejected)
    assert any(not isinstance(r, Exception) for r in results)
    assert disagg.wait_no_leaks() == {}


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "top_p": 0.0}, "top_p"),
        ({"prompt_token_ids": [1, 10**6]}, "prompt_token_ids"),
        ({"prompt": "word " * 5000}, "prompt"),
    ],
)
def test_bad_input_is_invalid_argument(disagg, request_kwargs, field):
    async def run():
        async with TandemClient(disagg.address) as client:
            prompt = request_kwargs.pop("prompt", None)
            if prompt is None:
                prompt = request_kwargs.pop("prompt_token_ids")
            await client.complete(prompt, **request_kwargs)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
