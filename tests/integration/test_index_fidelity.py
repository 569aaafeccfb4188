"""Index fidelity end to end (1 prefill + 1 decode worker, Ray on loopback):
a served request's timings carry the prefix hit the index predicted and the
one the worker realized, matching what the workload shares; an index entry
made stale shows as a shortfall, Admin.ReconcileIndex finds and removes it,
and the metrics count both. Then ``tandem bench --rate-schedule`` over the
HTTP front reports windows and the pool sizes it sampled from /metrics."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from benchkit.deployment import Deployment
from block_index import KVEvent
from engine.hashing import hash_blocks, root_hash
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.client import TandemClient
from router.config import ServeConfig
from tandem_cli.main import main
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16
ADMIN = "sk-admin-fidelity"
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


def _tokens(n: int, seed: int) -> list[int]:
    return [10 + (seed * 7919 + j * 104729) % 30000 for j in range(n)]


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = ServeConfig(
        engine={"kv_cache_memory_mb": 32, "block_size": BS},
        # Every prompt through the prefill pool; reconcile on demand only.
        routing={"local_prefill_tokens": 0, "index_reconcile_interval_s": 0},
        server={"http_port": 0},
        security={"admin_keys": [ADMIN]},
    )
    with deployed(config) as d:
        yield d


def _complete(address: str, prompt: list[int]):
    async def run():
        async with TandemClient(address) as client:
            return await client.complete(prompt, **GREEDY)

    return asyncio.run(run())


def _reconcile(address: str) -> admin_pb2.ReconcileIndexReply:
    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            return await stub.ReconcileIndex(
                admin_pb2.ReconcileIndexRequest(),
                metadata=(("authorization", f"Bearer {ADMIN}"),),
                timeout=60,
            )

    return asyncio.run(run())


def _metric(d: Deployment, line_start: str) -> float:
    text = httpx.get(f"{d.http_url}/metrics", timeout=30).text
    (line,) = [x for x in text.splitlines() if x.startswith(line_start + " ")]
    return float(line.split()[-1])


def test_timings_carry_predicted_and_realized_hits(deployment):
    shared = _tokens(4 * BS, 1)  # 4 full blocks every prompt below starts with
    first = _complete(deployment.address, shared + _tokens(20, 2))
    assert first.timings.predicted_cached_tokens == 0
    assert first.timings.realized_cached_tokens == 0 == first.usage.cached_tokens
    second = _complete(deployment.address, shared + _tokens(20, 3))
    assert second.timings.predicted_cached_tokens == 4 * BS
    assert second.timings.realized_cached_tokens == 4 * BS == second.usage.cached_tokens
    assert _metric(deployment, 'tandem_prefix_hit_requests_total{outcome="as_predicted"}') >= 1


def test_a_stale_entry_shows_as_a_shortfall_and_reconcile_removes_it(deployment):
    backend = deployment.backend
    (prefill,) = backend.prefill.workers
    prompt = _tokens(3 * BS + 5, 7)  # cached nowhere
    root = root_hash(prefill.info.model_fingerprint, BS)
    stale = tuple(hash_blocks(prompt, BS, root)[:3])
    # The index believes prefill-0 holds the prompt's 3 blocks: it does not.
    deployment.run(asyncio.to_thread(backend.index.apply, KVEvent(prefill.name, stored=stale)))
    before = _metric(deployment, "tandem_prefix_hit_shortfall_tokens_sum")
    out = _complete(deployment.address, prompt)
    assert out.timings.predicted_cached_tokens == 3 * BS
    assert out.timings.realized_cached_tokens == 0
    assert _metric(deployment, "tandem_prefix_hit_shortfall_tokens_sum") == before + 3 * BS

    # The request cached its blocks for real since: cache a fresh stale one.
    fake = (b"\x01" * 16, b"\x02" * 16)
    deployment.run(asyncio.to_thread(backend.index.apply, KVEvent(prefill.name, stored=fake)))
    reply = _reconcile(deployment.address)
    assert reply.checked_workers == 2 and not reply.unreachable
    assert reply.stale_entries == 2 and dict(reply.stale_by_worker) == {prefill.name: 2}
    assert not set(fake) & backend.index.blocks(prefill.name)
    assert set(stale) <= backend.index.blocks(prefill.name)  # held now: kept
    assert _metric(deployment, "tandem_index_stale_entries") == 2
    assert _reconcile(deployment.address).stale_entries == 0
    assert _metric(deployment, "tandem_index_stale_entries") == 0


def test_bench_rate_schedule_reports_windows_and_pool_sizes(deployment, tmp_path, capsys):
    rc = main(
        [
            "bench", "--target", deployment.http_url, "--rate-schedule", "0:2,3:6",
            "--duration", "6", "--window", "3", "--input-len", "16:32", "--output-len", "4",
            "--pool-sample-interval", "0.5", "--out", str(tmp_path), "--no-progress",
            "--slo", "ttft_ms=100000",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    assert rc == 0
    plot = tmp_path / "schedule.png"
    assert f"plot: {plot}" in out and plot.read_bytes()[:4] == b"\x89PNG"
    (run,) = json.loads((tmp_path / "report.json").read_text())["runs"]
    sched = run["schedule"]
    assert [(w["start_s"], w["end_s"]) for w in sched["windows"]] == [(0, 3), (3, 6)]
    assert [w["offered_rate"] for w in sched["windows"]] == [2, 6]
    assert sum(w["sent"] for w in sched["windows"]) == run["summary"]["requests"]
    assert all(w["failed"] == 0 for w in sched["windows"])
    assert sched["expected_requests"] == 2 * 3 + 6 * 3
    pools = {(s["pool"], s["workers"]) for s in sched["pool_samples"]}
    assert pools == {("prefill", 1), ("decode", 1)}
