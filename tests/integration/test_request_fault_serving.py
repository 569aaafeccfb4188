"""Faults tied to one request, through a real deployment: a request whose
logits turn NaN (tests/faults.py's hook, on every worker) fails alone, with
INTERNAL on gRPC and a 500 JSON error on HTTP, after one more try; the
streams running beside it finish with the engine's exact tokens; no block
is left held, and every worker stays in routing (the fault was the
request's, not theirs)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed
from tests.faults import NAN_LATE_PROMPT, NAN_PROMPT, FaultyDecodeActor, FaultyPrefillActor

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9] * k for k in (1, 4, 9)]
NAN_MESSAGE = "non-finite logits"


@pytest.fixture(scope="module")
def dep(ray_cluster):
    config = ServeConfig(
        pools={"prefill": 1, "decode": 2},
        engine={"kv_cache_memory_mb": 32},
        server={"http_port": 0},
    )
    actors = {"prefill": FaultyPrefillActor, "decode": FaultyDecodeActor}
    with deployed(config, actor_classes=actors) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    outs = llm.generate(PROMPTS, [SamplingParams(**GREEDY)] * len(PROMPTS))
    return [o.token_ids for o in outs]


async def _tokens(client: TandemClient, prompt: list[int]) -> list[int]:
    return (await client.complete(prompt, **GREEDY)).token_ids


async def _failing(
    client: TandemClient, prompt: list[int]
) -> tuple[list[int], grpc.aio.AioRpcError]:
    """The tokens streamed before the call failed, and its error."""
    streamed: list[int] = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for r in client.generate(prompt, **GREEDY):
            streamed += r.chunk.token_ids
    return streamed, err.value


@pytest.mark.parametrize("marker", [NAN_PROMPT, NAN_LATE_PROMPT], ids=["at_prefill", "in_decode"])
def test_a_nan_request_fails_alone_and_the_others_keep_their_tokens(dep, reference, marker):
    async def run():
        async with TandemClient(dep.address, timeout_s=120) as client:
            return await asyncio.gather(
                _failing(client, [*marker, 40, 41, 42]),
                *(_tokens(client, p) for p in PROMPTS),
            )

    faulted = dep.backend.failover.faulted
    (streamed, err), *others = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "failed in 2 tries" in err.details() and NAN_MESSAGE in err.details()
    assert len(streamed) == (0 if marker == NAN_PROMPT else 2)
    assert others == reference
    assert dep.backend.failover.faulted == faulted + 1
    # The fault was the request's: every worker is still in routing.
    assert (len(dep.backend.prefill.workers), len(dep.backend.decode.workers)) == (1, 2)
    assert dep.wait_no_leaks() == {}


def test_a_nan_request_over_http_gets_a_500_json_error(dep):
    reply = httpx.post(
        f"{dep.http_url}/v1/completions",
        json={"model": "tandem-tiny-llama", "prompt": [*NAN_PROMPT, 40], **GREEDY},
        timeout=120,
    )
    assert reply.status_code == 500
    error = reply.json()["error"]
    assert NAN_MESSAGE in error["message"] and "Traceback" not in reply.text
    assert dep.wait_no_leaks() == {}
