"""Disaggregated serving with tensor-parallel workers: prefill at TP=a, decode
at TP=b, for (a, b) = (1, 2), (2, 1) and (2, 2), one deployment each (one
prefill and one decode worker; each rank beyond the first is a Ray actor in
the worker's placement group).

Greedy output through the router equals the engine alone (TP=1): the KV
blocks reach the decode worker whole (gathered from the prefill worker's
ranks, scattered to the decode worker's), and a second round of the same
prompts reuses the decode worker's cached prefix blocks. Every block comes
back, and a removed worker's placement group goes with it. A lost rank
restarts its worker whole.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from router.pool_manager import placement_name
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
TEXTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 6,  # several blocks to move
]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
KV_MB = 16


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=KV_MB << 20)
    params = SamplingParams(**GREEDY)
    return {t: out for t, out in zip(TEXTS, llm.generate(TEXTS, params), strict=True)}


def _config(prefill_tp: int, decode_tp: int) -> ServeConfig:
    return ServeConfig(
        engine={"kv_cache_memory_mb": KV_MB},
        pools={
            "prefill": 1,
            "decode": 1,
            "prefill_resources": {"tensor_parallel_size": prefill_tp},
            "decode_resources": {"tensor_parallel_size": decode_tp},
        },
        routing={"prefix_routing": False},  # every request through the prefill worker
        transfer={"lease_s": 120},  # blocks must come back by the requests, not the lease
    )


async def _complete_all(address: str, prompts):
    async with TandemClient(address) as client:
        return await asyncio.gather(*(client.complete(p, **GREEDY) for p in prompts))


def _live_placements() -> set[str]:
    return {
        info["name"]
        for info in ray.util.placement_group_table().values()
        if info["state"] != "REMOVED"
    }


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_greedy_across_layouts_equals_engine(ray_cluster, reference, prefill_tp, decode_tp):
    with deployed(_config(prefill_tp, decode_tp)) as d:
        workers = d.backend.prefill.workers + d.backend.decode.workers
        tp = {w.role: {"prefill": prefill_tp, "decode": decode_tp}[w.role] for w in workers}
        placed = {placement_name(w.name) for w in workers if tp[w.role] > 1}
        assert placed <= _live_placements()
        for w in workers:  # rank 0 is the worker's actor; the others run beside it
            assert len(ray.get(w.actor.rank_pids.remote())) == tp[w.role] - 1
        first = asyncio.run(_complete_all(d.address, TEXTS))
        again = asyncio.run(_complete_all(d.address, TEXTS))  # D's cached prefix is reused
        for outs in (first, again):
            for text, out in zip(TEXTS, outs, strict=True):
                assert out.token_ids == reference[text].token_ids
                assert out.text == reference[text].text
        assert d.wait_no_leaks() == {}
    assert not placed & _live_placements()  # stopping the workers removed their groups


def test_a_lost_rank_restarts_its_worker_whole(ray_cluster, reference):
    """SIGKILL of a decode worker's second rank: the worker's rank 0 ends its
    process, Ray restarts the worker with new ranks, the router routes to it
    again, and it serves exactly; no block is left behind."""
    with deployed(_config(1, 2)) as d:
        (decode,) = d.backend.decode.workers
        (rank_pid,) = ray.get(decode.actor.rank_pids.remote())
        worker_pid = ray.get(decode.actor.pid.remote())
        recovered = d.backend.failover.workers_recovered
        os.kill(rank_pid, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while d.backend.failover.workers_recovered == recovered:
            assert time.monotonic() < deadline, "the decode worker did not come back"
            time.sleep(0.5)
        (decode,) = d.backend.decode.workers
        assert ray.get(decode.actor.pid.remote()) != worker_pid  # restarted by Ray
        assert ray.get(decode.actor.rank_pids.remote()) != [rank_pid]  # with a new rank
        outs = asyncio.run(_complete_all(d.address, TEXTS))
        assert [o.token_ids for o in outs] == [reference[t].token_ids for t in TEXTS]
        assert d.wait_no_leaks() == {}
