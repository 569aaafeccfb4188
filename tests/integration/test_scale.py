"""Pools resized at run time under load: no request fails, outputs stay exact,
removed workers drain first, and the workers left hold no stranded blocks.
A resize Ray cannot place fails in pools.placement_timeout_s and the router
serves on. ``tandem scale`` sends the admin key in $TANDEM_ADMIN_KEY."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tandem_cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ADMIN = "sk-admin-test"
SECURITY = {"admin_keys": [ADMIN]}


@pytest.fixture(autouse=True)
def admin_key(monkeypatch):
    monkeypatch.setenv("TANDEM_ADMIN_KEY", ADMIN)


def _prompt(i: int) -> list[int]:
    return [10 + (i * 7919 + j * 104729) % 30000 for j in range(20 + i % 40)]


MAX_REQUESTS = 3000  # the load's bound, should the test go wrong


def _served_by(results: list) -> set[str]:
    return {r.timings.decode_worker for r in results} | {r.timings.prefill_worker for r in results}


def _wait_for(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(900)  # a load through two resizes; the loader alone may take 300 s
def test_resize_under_load_fails_no_request(ray_cluster, capsys):
    d = Deployment(
        ServeConfig(engine={"kv_cache_memory_mb": 32}, transfer={"lease_s": 120}, security=SECURITY)
    )
    try:
        stop = threading.Event()
        sent: list[list[int]] = []
        results: list = []

        async def load():  # 4 streams at a time until told to stop
            async with TandemClient(d.address) as client:

                async def stream(k: int):
                    i = k
                    while not stop.is_set() and i < MAX_REQUESTS:
                        prompt = _prompt(i)
                        out = await client.complete(
                            prompt, temperature=0, max_tokens=24, ignore_eos=True
                        )
                        sent.append(prompt)
                        results.append(out)
                        i += 4

                await asyncio.gather(*(stream(k) for k in range(4)))

        first_workers = {w.name for w in d.backend.prefill.workers + d.backend.decode.workers}
        loader = threading.Thread(target=lambda: asyncio.run(load()))
        loader.start()
        _wait_for(lambda: len(results) >= 8)
        assert main(["scale", "--target", d.address, "--prefill", "2", "--decode", "2"]) == 0
        assert "prefill 2, decode 2" in capsys.readouterr().out
        # The load reaches the new workers (a fixed wait was too short or too
        # long, depending on how fast the workers ran).
        _wait_for(lambda: _served_by(results) - first_workers)
        assert loader.is_alive(), "the load ended before it reached the new workers"
        assert main(["scale", "--target", d.address, "--prefill", "1", "--decode", "1"]) == 0
        time.sleep(1.0)
        stop.set()
        loader.join(timeout=300)
        assert not loader.is_alive()
        llm = LLM(None, kv_cache_memory_bytes=32 << 20)
        reference = llm.generate(
            sent, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
        assert _served_by(results) - first_workers  # the added workers took part
        assert len(d.backend.prefill.workers) == 1 and len(d.backend.decode.workers) == 1
        assert d.wait_no_leaks() == {}
    finally:
        d.stop()


def test_scale_refuses_bad_sizes(ray_cluster, capsys):
    d = Deployment(
        ServeConfig(
            pools={"mode": "colocated"}, engine={"kv_cache_memory_mb": 32}, security=SECURITY
        )
    )
    try:
        assert main(["scale", "--target", d.address, "--decode", "0"]) == 1
        assert "INVALID_ARGUMENT" in capsys.readouterr().err
        assert main(["scale", "--target", d.address, "--prefill", "2"]) == 1
        assert main(["scale", "--target", d.address]) == 2
    finally:
        d.stop()


def test_a_scale_ray_cannot_place_times_out_and_the_router_serves_on(ray_cluster, capsys):
    # The test cluster has 8 CPUs: 1 prefill worker (1 CPU) and 1 decode worker
    # (4 CPUs) fit, a second decode worker (4 more) does not.
    pools = {"decode_resources": {"num_cpus": 4}, "placement_timeout_s": 5}
    config = ServeConfig(engine={"kv_cache_memory_mb": 32}, pools=pools, security=SECURITY)
    d = Deployment(config)
    try:
        before = {w.name for w in d.backend.decode.workers}
        assert main(["scale", "--target", d.address, "--decode", "2"]) == 1
        err = capsys.readouterr().err
        assert "DEADLINE_EXCEEDED" in err and "pools.placement_timeout_s" in err
        assert {w.name for w in d.backend.decode.workers} == before
        prompt = _prompt(1)
        out = asyncio.run(_complete(d.address, prompt))
        llm = LLM(None, kv_cache_memory_bytes=32 << 20)
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert out.token_ids == llm.generate([prompt], greedy)[0].token_ids
        # The scale lock is free again: a resize that starts nothing goes through.
        assert main(["scale", "--target", d.address, "--decode", "1"]) == 0
        assert "prefill 1, decode 1" in capsys.readouterr().out
        assert d.wait_no_leaks() == {}
    finally:
        d.stop()


async def _complete(address: str, prompt: list[int]):
    async with TandemClient(address) as client:
        return await client.complete(prompt, temperature=0, max_tokens=8, ignore_eos=True)
