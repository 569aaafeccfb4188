"""Chaos: workers die, transfers break and Redis restarts while a load of
concurrent streams runs through the router.

Every request must complete, token for token equal to the engine alone
(greedy, and seeded sampling), and every worker in routing afterwards (the
survivors, and the restarted ones once back) must have its starting free
block count. The tests print what they did (requests, kills, retries) for
the failover report.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import time
import uuid

import pytest
import ray

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient, collect
from router.config import ServeConfig
from router.failover import RetryPolicy
from router.pool_manager import WorkerHandle
from tests.faults import FaultyPrefillActor, TransferFaults
from tests.integration.worker_kills import freeze, kill, stop_midway

# Kills, restarts and recoveries under load; the module's teardown waits up to
# 240 s for every worker to be back.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 40
TRANSFER_TIMEOUT_S = 4.0
TEXTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Handler:\n    def __init__(self, path):\n" * 8,
    "x",
    "The quick brown fox jumps over the lazy dog. " * 30,
    "for i in range(10):\n    print(i)\n",
    "Once upon a time, in a land far away, ",
]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _seeded(seed: int) -> dict:
    return {"temperature": 0.9, "top_p": 0.95, "seed": seed, "max_tokens": MAX_TOKENS,
            "ignore_eos": True}  # fmt: skip


# (prompt, sampling) of each stream of a load: greedy and seeded sampled
LOAD = [(TEXTS[i % len(TEXTS)], GREEDY if i % 3 else _seeded(i)) for i in range(12)]
TOTALS = {"requests": 0, "killed": 0, "faults": 0, "retries": 0, "resumed": 0}


@pytest.fixture(scope="module")
def reference():
    """The engine alone: outputs of every (prompt, sampling) of LOAD."""
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    keys = sorted({(p, tuple(sorted(s.items()))) for p, s in LOAD})
    outs = llm.generate([p for p, _ in keys], [SamplingParams(**dict(s)) for _, s in keys])
    return {k: o.token_ids for k, o in zip(keys, outs, strict=True)}


def _key(prompt: str, sampling: dict) -> tuple:
    return (prompt, tuple(sorted(sampling.items())))


CONFIG = ServeConfig(
    pools={"prefill": 2, "decode": 2, "worker_max_restarts": 4},
    engine={"kv_cache_memory_mb": 32},
    # A long lease: blocks must come back through the abort paths.
    transfer={"lease_s": 120, "timeout_s": TRANSFER_TIMEOUT_S},
    limits={"max_queued_requests": 256},
    # A hung worker is noticed within seconds.
    tuning={"max_attempts": 8, "stall_check_s": 1.0, "health_timeout_s": 3.0},
)


def _deployment(actor_classes: dict | None = None, **sections) -> Deployment:
    """A deployment of CONFIG with ``sections`` changed, retrying sooner than
    RETRY_BACKOFF_S so that a run of failures stays short."""
    deployment = Deployment(CONFIG.updated(**sections), actor_classes=actor_classes)
    deployment.backend.retry = RetryPolicy(CONFIG.tuning.max_attempts, backoff_s=0.05)
    return deployment


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    # Prefill workers that take transfer faults on demand (tests/faults.py).
    deployment = _deployment(actor_classes={"prefill": FaultyPrefillActor})
    yield deployment
    try:
        _wait_recovered(deployment)
        assert deployment.wait_no_leaks(60) == {}
    finally:
        stats = deployment.backend.failover
        print(f"\nchaos totals: {TOTALS}, failover: {stats}")
        deployment.stop()


def _wait_recovered(d: Deployment, timeout_s: float = 240) -> None:
    """Until every worker is back in routing."""
    deadline = time.monotonic() + timeout_s
    b = d.backend
    while time.monotonic() < deadline:
        pools = d.config.pools
        if len(b.prefill.workers) == pools.prefill and len(b.decode.workers) == pools.decode:
            return
        time.sleep(0.5)
    raise AssertionError(f"workers not back: {[w.name for w in b.recovery.down]}")


def _kill(worker: WorkerHandle, pid: int, how: str) -> None:
    kill(worker, pid, how)
    TOTALS["killed"] += 1


async def _load(address: str, actions: list[tuple[int, object]]) -> list:
    """Run LOAD concurrently; each action runs (in a thread) once the streams
    together have received its number of tokens. An action that returns False
    runs again after the next tokens arrive. Actions that take an argument get
    the tokens received so far by each stream's request id."""
    received, open_streams = 0, len(LOAD)
    counts: dict[str, int] = {}
    tag = uuid.uuid4().hex[:8]
    due = [(n, asyncio.Event(), act) for n, act in actions]

    async def stream(client: TandemClient, i: int, prompt: str, sampling: dict):
        nonlocal received, open_streams
        responses = []
        rid = f"load-{tag}-{i}"
        counts[rid] = 0
        try:
            async for r in client.generate(prompt, request_id=rid, **sampling):
                responses.append(r)
                received += len(r.chunk.token_ids)
                counts[rid] += len(r.chunk.token_ids)
                for n, event, _ in due:
                    if received >= n:
                        event.set()
        finally:
            open_streams -= 1
            for n, event, _ in due:
                if received >= n or not open_streams:
                    event.set()  # an action waiting to run again sees the end
        return collect(responses)

    async def act(event: asyncio.Event, action) -> None:
        args = (counts,) if inspect.signature(action).parameters else ()
        while open_streams:
            await event.wait()
            event.clear()
            if await asyncio.to_thread(action, *args) is not False:
                return

    async with TandemClient(address) as client:
        streams = [stream(client, i, p, s) for i, (p, s) in enumerate(LOAD)]
        results = await asyncio.gather(*streams, *(act(e, a) for _, e, a in due))
    TOTALS["requests"] += len(LOAD)
    return results[: len(LOAD)]


def _check(outs: list, reference: dict) -> None:
    for (prompt, sampling), out in zip(LOAD, outs, strict=True):
        assert out.finish_reason == "length"
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.token_ids == reference[_key(prompt, sampling)], (prompt[:20], sampling)


def _count(d: Deployment) -> None:
    stats = d.backend.failover
    TOTALS["retries"], TOTALS["resumed"] = stats.retries, stats.resumed


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_kill_prefill_and_decode_during_load(cluster, reference, how):
    _wait_recovered(cluster)
    b = cluster.backend
    before = (b.failover.retries, b.failover.resumed, b.failover.workers_recovered)
    # A frozen prefill worker holds the requests routed to it in their prefill
    # until it is killed; a decode worker is frozen, then killed, once the
    # streams are about a quarter through, and only while one of its streams is
    # mid-way (tokens sent, not finished): that stream must resume elsewhere.
    prefill = b.prefill.workers[0]
    prefill_pid = freeze(prefill)
    in_flight = []

    def kill_prefill():
        _kill(prefill, prefill_pid, how)

    def kill_decode(counts) -> bool:
        stopped = stop_midway(b.decode.workers, b.streams, counts, MAX_TOKENS)
        if stopped is None:
            return False
        in_flight.append(stopped[0].in_flight)
        _kill(*stopped, how)
        return True

    try:
        actions = [(1, kill_prefill), (len(LOAD) * 10, kill_decode)]
        outs = asyncio.run(_load(cluster.address, actions))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(prefill_pid, signal.SIGCONT)
    _check(outs, reference)
    assert in_flight and in_flight[0] > 0  # the decode worker had streams when it died
    assert b.failover.retries > before[0]
    assert b.failover.resumed > before[1]  # streams continued on another pair
    assert b.failover.failed == 0
    _wait_recovered(cluster)
    assert b.failover.workers_recovered >= before[2] + 2  # both came back after restarts
    assert cluster.wait_no_leaks(60) == {}
    # The restarted workers serve again, exactly.
    _check(asyncio.run(_load(cluster.address, [])), reference)
    assert cluster.wait_no_leaks(60) == {}
    _count(cluster)


def test_hung_decode_worker_fails_over(cluster, reference):
    b = cluster.backend
    _wait_recovered(cluster)
    resumed, stopped = b.failover.resumed, []

    def stop(counts) -> bool:  # the process hangs: no error, no broken stream, just silence
        frozen = stop_midway(b.decode.workers, b.streams, counts, MAX_TOKENS)
        if frozen is not None:
            stopped.append(frozen[1])
        return frozen is not None

    try:
        outs = asyncio.run(_load(cluster.address, [(len(LOAD) * 10, stop)]))
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    _check(outs, reference)
    assert stopped and b.failover.resumed > resumed
    _wait_recovered(cluster)  # the same process, running again, passes its health check
    assert cluster.wait_no_leaks(60) == {}  # it freed what the failed tries left there
    TOTALS["killed"] += 1
    _count(cluster)


@pytest.mark.parametrize("fault", ["corrupt", "stall"])
def test_broken_transfers_are_retried(cluster, reference, fault):
    b = cluster.backend
    if fault == "corrupt":
        faults = TransferFaults(corrupt_pushes=1)
    else:
        faults = TransferFaults(stall_pushes=1, stall_s=TRANSFER_TIMEOUT_S + 2)
    _wait_recovered(cluster)
    for w in b.prefill.workers:
        ray.get(w.actor.set_faults.remote(faults), timeout=30)
    retries = b.failover.retries
    outs = asyncio.run(_load(cluster.address, []))
    _check(outs, reference)
    injected = sum(ray.get(w.actor.faults_injected.remote(), timeout=30) for w in b.prefill.workers)
    assert injected == len(b.prefill.workers)  # each prefill worker broke one push
    assert b.failover.retries >= retries + injected
    assert b.failover.failed == 0
    assert cluster.wait_no_leaks(60) == {}
    TOTALS["faults"] += injected
    _count(cluster)


def test_a_prefill_worker_killed_half_way_through_a_streamed_push(cluster, reference):
    """A prefill worker dies (SIGKILL) at its first chunk, the push's header
    accepted and its blocks reserved on the decode worker, while the prompt
    is still being computed (transfer.stream): the decode worker frees the
    blocks, the router retries on a healthy pair, the dead worker comes back."""
    b = cluster.backend
    _wait_recovered(cluster)
    victim = b.prefill.workers[0]
    ray.get(victim.actor.set_faults.remote(TransferFaults(kill_pushes=1)), timeout=30)
    retries, recovered = b.failover.retries, b.failover.workers_recovered
    outs = asyncio.run(_load(cluster.address, []))
    _check(outs, reference)
    assert b.failover.retries > retries  # the push died with its worker: retried
    assert b.failover.failed == 0
    _wait_recovered(cluster)
    assert b.failover.workers_recovered > recovered
    assert cluster.wait_no_leaks(60) == {}
    TOTALS["killed"] += 1
    _count(cluster)


def test_redis_stop_and_restart_during_load(ray_cluster, reference, redis_server):
    d = _deployment(pools={"prefill": 1, "decode": 2}, routing={"redis_url": redis_server.url})
    try:
        outs = asyncio.run(
            _load(
                d.address,
                [(len(LOAD) * 5, redis_server.stop), (len(LOAD) * 20, redis_server.start)],
            )
        )
        _check(outs, reference)
        deadline = time.monotonic() + 60
        while not d.backend.index.healthy and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d.backend.index.healthy  # the index found Redis again by itself
        _check(asyncio.run(_load(d.address, [])), reference)  # a load with Redis back
        assert d.backend.failover.failed == 0
        assert d.wait_no_leaks(60) == {}
    finally:
        d.stop()


def test_colocated_worker_killed_mid_stream(ray_cluster, reference):
    d = _deployment(pools={"mode": "colocated", "prefill": 0, "decode": 2})
    try:

        def kill(counts) -> bool:
            stopped = stop_midway(d.backend.decode.workers, d.backend.streams, counts, MAX_TOKENS)
            if stopped is not None:
                _kill(*stopped, "SIGKILL")
            return stopped is not None

        outs = asyncio.run(_load(d.address, [(len(LOAD) * 10, kill)]))
        _check(outs, reference)
        assert d.backend.failover.resumed > 0  # streams went on on the other worker
        assert d.backend.failover.failed == 0
        _wait_recovered(d)
        assert d.wait_no_leaks(60) == {}
    finally:
        d.stop()
