"""A client survives the SIGKILL of the router carrying its streams (issue 26,
the first test): two routers on one named deployment, one in this process
and one in a process of its own; 32 concurrent streams, each through a
TandemClient that knows both routers and starts at the one in the other
process; that process is SIGKILLed once every stream has tokens, or earlier
once one stream has three quarters of its tokens (so that none has finished). Nothing
fails: every stream goes on at the other router, after the tokens its client
had; greedy output equals the engine alone, seeded sampled output an
uninterrupted run; the worker actors are the same ones, in the same
processes; every worker's free blocks are back to their start.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

import pytest

from engine import LLM
from protocol.sampling import SamplingParams
from router import deployment as dep_mod
from router.backend import GenerateInput
from router.client import TandemClient, collect
from router.config import ServeConfig
from router.ray_backend import RayBackend
from tests.deployment_helpers import (
    RouterProcess,
    actor_ids,
    deployed,
    router_process,
    worker_processes,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = f"loss-{secrets.token_hex(4)}"
STREAMS = 32
MAX_TOKENS = 96
# Tokens of the furthest stream, at the latest, when the router is killed:
# the router may be that stream's whole rest ahead of this client (its
# chunks merge what is queued), so the rest is long: 60 tokens.
KILL_AT = 36
PROMPTS = [f"def f{i}(x):\n    return x * {i} +" for i in range(STREAMS)]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
CONFIG = ServeConfig(
    engine={"kv_cache_memory_mb": 32},  # as the router process's (the driver's)
    routing={"prefix_routing": False},
    transfer={"lease_s": 120},  # blocks must come back through the aborts, not the lease
    deployment={"name": NAME},
)


def _sampling(kind: str, i: int) -> dict:
    return GREEDY if kind == "greedy" else {**GREEDY, "temperature": 0.8, "seed": 1000 + i}


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(**GREEDY))
    return [(o.text, o.token_ids) for o in outs]


class RecordingBackend(RayBackend):
    """The surviving router's backend; records the requests it serves."""

    resumed: dict[str, list[int]]  # request id: the tokens it resumed after (maybe none)

    def generate(self, inp: GenerateInput):
        self.resumed[inp.request_id] = list(inp.resume_token_ids)
        return super().generate(inp)


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    """The deployment's pools and the router that survives, in this process."""
    try:
        with deployed(CONFIG, backend_cls=RecordingBackend) as deployment:
            deployment.backend.resumed = {}
            yield deployment
    finally:
        if dep_mod.exists(NAME):
            dep_mod.down(NAME, drain_timeout_s=5)


@dataclass
class Stream:
    responses: list = field(default_factory=list)
    at_kill: int = -1  # responses received when the router was killed (-1: before the kill)


async def _streams_through_a_lost_router(victim: RouterProcess, survivor: str, kind: str):
    """STREAMS streams started at ``victim``, killed once all of them carry
    tokens or one has KILL_AT tokens (prefills are one after another: the
    first streams could end before the last start). The kill comes from the
    stream whose response met the condition, before it awaits again: no other
    response can slip in between (a chunk may carry several tokens)."""
    streams = [Stream() for _ in range(STREAMS)]
    killed = False

    def kill_if_ready(s: Stream) -> None:
        nonlocal killed
        tokens = sum(len(r.chunk.token_ids) for r in s.responses)
        if killed or not (tokens >= KILL_AT or all(x.responses for x in streams)):
            return
        killed = True
        victim.kill()  # synchronous: no more awaits before it
        for x in streams:
            x.at_kill = len(x.responses)

    async def one(i: int) -> None:
        s = streams[i]
        # A client's first request starts at its first router: the victim.
        async with TandemClient([victim.address, survivor], timeout_s=240) as client:
            sampling = {**_sampling(kind, i), "request_id": f"{kind}-{i}"}
            async for response in client.generate(PROMPTS[i], **sampling):
                s.responses.append(response)
                kill_if_ready(s)

    await asyncio.gather(*(one(i) for i in range(STREAMS)))
    return streams


async def _uninterrupted(address: str, kind: str, prompts=PROMPTS) -> list:
    async with TandemClient(address, timeout_s=240) as client:
        return await asyncio.gather(
            *(client.complete(p, **_sampling(kind, i)) for i, p in enumerate(prompts))
        )


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_streams_survive_the_sigkill_of_their_router(deployment, reference, kind):
    start_free = {n: s.free_blocks for n, s in deployment.worker_stats().items()}
    workers = actor_ids(deployment.backend)
    processes = worker_processes(deployment.backend)
    expected = asyncio.run(_uninterrupted(deployment.address, kind))
    deployment.backend.resumed.clear()
    if kind == "greedy":
        assert [(o.text, o.token_ids) for o in expected] == reference
    assert deployment.wait_no_leaks() == {}

    with router_process(NAME) as victim:
        # it attached to the same workers, in the same processes
        assert victim.workers == {name: pid for name, (pid, _) in processes.items()}
        [first] = asyncio.run(_uninterrupted(victim.address, kind, PROMPTS[:1]))
        assert first.token_ids == expected[0].token_ids  # and serves (now warm)
        streams = asyncio.run(_streams_through_a_lost_router(victim, deployment.address, kind))
        assert victim.process.wait(30) < 0  # killed by the signal

    # Every stream was under way at the victim when it died: no final (most with tokens).
    assert any(s.at_kill >= 1 for s in streams)
    for s in streams:
        assert s.at_kill >= 0
        assert not any(r.HasField("final") for r in s.responses[: s.at_kill])
    done = [collect(s.responses) for s in streams]  # raises for a stream without a final
    assert [(d.text, d.token_ids) for d in done] == [(e.text, e.token_ids) for e in expected]
    assert all(d.finish_reason == "length" for d in done)
    assert all(d.usage.completion_tokens == MAX_TOKENS for d in done)
    # ... and every one went on at the survivor, after the tokens its client had.
    resumed = deployment.backend.resumed
    assert sorted(resumed) == sorted(f"{kind}-{i}" for i in range(STREAMS))
    for i, (s, d) in enumerate(zip(streams, done, strict=True)):
        after = resumed[f"{kind}-{i}"]
        read = sum(len(r.chunk.token_ids) for r in s.responses[: s.at_kill])
        assert read <= len(after) < MAX_TOKENS
        assert after == d.token_ids[: len(after)]

    assert actor_ids(deployment.backend) == workers
    assert worker_processes(deployment.backend) == processes  # same pids, no restart
    assert deployment.wait_no_leaks() == {}
    assert {n: s.free_blocks for n, s in deployment.worker_stats().items()} == start_free
