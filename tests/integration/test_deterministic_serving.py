"""Deterministic mode through the whole stack (docs/deterministic.md): every
prompt of a concurrent load, greedy and seeded, gets tokens and logprobs bit
for bit equal to the engine alone running that prompt by itself, in a
colocated deployment and in a disaggregated one whose decode worker is
killed mid-stream (the streams resume on the other one), with prefix hits
from prompts the load repeats."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient, collect
from router.config import ServeConfig
from router.failover import RetryPolicy
from tests.integration.worker_kills import kill, stop_midway

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAX_TOKENS = 24
TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Handler:\n    def __init__(self, path):\n" * 4,
    "x",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Once upon a time, in a land far away, ",
]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2}
SEEDED = {**GREEDY, "temperature": 0.9, "top_p": 0.95, "seed": 3}
# Every text twice (the second time a prefix hit on the worker that has it),
# greedy and seeded.
LOAD = [(TEXTS[i % len(TEXTS)], GREEDY if i % 4 < 2 else SEEDED) for i in range(2 * len(TEXTS))]
ENGINE = {"deterministic": True, "kv_cache_memory_mb": 32}


def _key(prompt: str, sampling: dict) -> tuple:
    return (prompt, tuple(sorted(sampling.items())))


@pytest.fixture(scope="module")
def reference() -> dict:
    """The engine alone, each (prompt, sampling) of LOAD by itself on a fresh
    engine: (token, logprob, top logprobs) per output token."""
    out = {}
    for prompt, sampling in {_key(p, s): (p, s) for p, s in LOAD}.values():
        llm = LLM(None, deterministic=True, kv_cache_memory_bytes=32 << 20, num_threads=1)
        (result,) = llm.generate([prompt], [SamplingParams(**sampling)])
        got = [(x.token_id, x.logprob, tuple(x.top)) for x in result.logprobs]
        out[_key(prompt, sampling)] = got
    return out


def _deployment(**pools) -> Deployment:
    config = ServeConfig(
        engine=ENGINE,
        pools={"worker_max_restarts": 4, **pools},
        tuning={"max_attempts": 8, "stall_check_s": 1.0, "health_timeout_s": 3.0},
    )
    deployment = Deployment(config)
    deployment.backend.retry = RetryPolicy(config.tuning.max_attempts, backoff_s=0.05)
    return deployment


async def _load(address: str, kill_after: int | None = None, on_kill=None) -> list:
    """LOAD, concurrently; once the streams have ``kill_after`` tokens,
    ``on_kill(counts)`` runs in a thread (again after more tokens while it
    returns False)."""
    tag, counts = uuid.uuid4().hex[:8], {}
    done = asyncio.Event()

    async def stream(client: TandemClient, i: int, prompt: str, sampling: dict):
        rid = f"det-{tag}-{i}"
        counts[rid], responses = 0, []
        async for r in client.generate(prompt, request_id=rid, **sampling):
            responses.append(r)
            counts[rid] += len(r.chunk.token_ids)
        return collect(responses)

    async def killer() -> None:
        while kill_after is not None and not done.is_set():
            if sum(counts.values()) >= kill_after and await asyncio.to_thread(on_kill, counts):
                return
            await asyncio.sleep(0.02)

    async with TandemClient(address) as client:
        watch = asyncio.create_task(killer())
        try:
            return await asyncio.gather(*(stream(client, i, p, s) for i, (p, s) in enumerate(LOAD)))
        finally:
            done.set()
            await watch


def _wait_until(condition, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _check(outs: list, reference: dict) -> int:
    """Every output equals its reference; the prompt tokens served from cache."""
    for (prompt, sampling), out in zip(LOAD, outs, strict=True):
        got = [
            (x.token_id, x.logprob, tuple((t.token_id, t.logprob) for t in x.top_logprobs))
            for x in out.logprobs
        ]
        assert got == reference[_key(prompt, sampling)], (prompt[:20], sampling)
    return sum(out.usage.cached_tokens for out in outs)


def test_colocated_equals_the_engine_alone(ray_cluster, reference):
    d = _deployment(mode="colocated", decode=1)
    try:
        first = asyncio.run(_load(d.address))
        _check(first, reference)
        assert _check(asyncio.run(_load(d.address)), reference) > 0  # prefix hits
        assert d.wait_no_leaks(60) == {}
    finally:
        d.stop()


def test_disaggregated_with_a_killed_decode_worker_equals_the_engine_alone(ray_cluster, reference):
    d = _deployment(prefill=1, decode=2)
    b, killed = d.backend, []

    def on_kill(counts) -> bool:
        stopped = stop_midway(b.decode.workers, b.streams, counts, MAX_TOKENS)
        if stopped is not None:
            killed.append(stopped[0].name)
            kill(*stopped, "SIGKILL")
        return stopped is not None

    try:
        outs = asyncio.run(_load(d.address, kill_after=len(LOAD) * 4, on_kill=on_kill))
        assert killed, "no decode worker had a stream mid-way"
        _check(outs, reference)
        assert b.failover.resumed > 0  # streams went on on the other decode worker
        assert b.failover.failed == 0
        assert _check(asyncio.run(_load(d.address)), reference) > 0  # prefix hits
        _wait_until(lambda: len(b.decode.workers) == 2)  # the killed one is back
        assert d.wait_no_leaks(90) == {}
    finally:
        d.stop()
