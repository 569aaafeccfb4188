"""A client that survives the loss of its router, end to end: two routers
(RouterServer) on one RayBackend, the one carrying a stream stopped without
grace mid-stream; the client goes on at the other, which resumes after the
tokens received. Greedy output equals the engine alone, seeded sampled output
an uninterrupted run; every worker's blocks come back."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from router.backend import GenerateInput
from router.client import TandemClient, collect
from router.config import ServeConfig
from router.service import RouterServer
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 48
CUT_AFTER = 5  # chunks the client reads from the first router
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "seed": 1234, "max_tokens": MAX_TOKENS, "ignore_eos": True}

CONFIG = ServeConfig(
    engine={"kv_cache_memory_mb": 32},
    pools={"prefill": 1, "decode": 1},
    routing={"prefix_routing": False},
    transfer={"lease_s": 120},  # blocks must come back through the aborts, not the lease
)


class SharedBackend:
    """The deployment's backend behind one more router, whose start and stop
    leave it alone (the deployment owns it); records the inputs it serves.
    ``hold_after``: a stream passes that many items, then waits until its
    router stops, so that the stop lands mid-stream however far the workers
    are ahead of the client."""

    def __init__(self, backend, hold_after: int | None = None) -> None:
        self._backend = backend
        self.hold_after = hold_after
        self.inputs: list[GenerateInput] = []

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def generate(self, inp: GenerateInput):
        self.inputs.append(inp)
        items = self._backend.generate(inp)
        return items if self.hold_after is None else self._held(items)

    async def _held(self, items):
        async with contextlib.aclosing(items):
            passed = 0
            async for item in items:
                yield item
                passed += 1
                if passed == self.hold_after:
                    await asyncio.Event().wait()  # until the router's stop cancels it

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    with deployed(CONFIG) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    [out] = llm.generate([PROMPT], SamplingParams(**GREEDY))
    return out


def _routers(
    deployment: Deployment, hold_after: list[int | None]
) -> list[tuple[RouterServer, SharedBackend]]:
    made = []
    for hold in hold_after:
        shared = SharedBackend(deployment.backend, hold)
        server = RouterServer(shared, host="127.0.0.1", port=0)
        deployment.run(server.start())
        made.append((server, shared))
    return made


async def _cut_mid_stream(deployment: Deployment, first: RouterServer, targets, sampling):
    """The responses a client of ``targets`` sees while ``first`` (carrying its
    stream) is stopped without grace after CUT_AFTER chunks."""
    async with TandemClient(targets, timeout_s=120) as client:
        stream = client.generate(PROMPT, **sampling)
        got = [await anext(stream) for _ in range(CUT_AFTER)]
        stop = asyncio.run_coroutine_threadsafe(first.stop(0), deployment.loop)
        await asyncio.wrap_future(stop)
        got += [r async for r in stream]
    return got


async def _uninterrupted(address: str, sampling):
    async with TandemClient(address, timeout_s=120) as client:
        return await client.complete(PROMPT, **sampling)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_stream_survives_its_router(deployment, reference, kind):
    sampling = GREEDY if kind == "greedy" else SEEDED
    (first, _), (second, shared) = _routers(deployment, [CUT_AFTER, None])
    try:
        expected = asyncio.run(_uninterrupted(second.address, sampling))
        shared.inputs.clear()
        targets = [first.address, second.address]
        got = asyncio.run(_cut_mid_stream(deployment, first, targets, sampling))
    finally:
        for server in (first, second):
            deployment.run(server.stop(0))
    done = collect(got)
    read = sum(len(r.chunk.token_ids) for r in got[:CUT_AFTER])
    [resumed] = shared.inputs  # the second router got the request once, resumed
    n = len(resumed.resume_token_ids)
    assert read <= n < MAX_TOKENS  # what the client had read when the router was lost, or more
    assert resumed.resume_token_ids == done.token_ids[:n]
    if kind == "greedy":
        assert done.token_ids == reference.token_ids
        assert done.text == reference.text
    assert done.token_ids == expected.token_ids
    assert done.text == expected.text
    assert done.finish_reason == "length"
    assert done.usage.completion_tokens == MAX_TOKENS
    assert deployment.wait_no_leaks() == {}
