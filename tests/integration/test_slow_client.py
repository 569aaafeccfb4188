"""A client that reads one message a second while other streams run on the
same decode worker (local Ray, the embedded tiny model, real gRPC).

The slow request's unread output in the router never passes
``limits.max_unread_output_kb`` (the router's own accounting, also exported
as ``tandem_unread_output_peak_bytes``); it ends with RESOURCE_EXHAUSTED
after the chunks already sent to it; the other streams' outputs equal the
engine alone; every worker's free blocks come back to their start.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from benchkit.deployment import Deployment
from engine import LLM
from protocol.sampling import SamplingParams
from protos.tandem.v1 import generate_pb2_grpc
from router.client import TandemClient, build_request
from router.config import ServeConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BOUND_KB = 1
MAX_TOKENS = 24
TEXTS = ["def fibonacci(n):", "for i in range(10):\n    print(i)\n", "import os\n" * 6]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
"""The slow client's HTTP/2 window: 1 KiB (without it its transport would take
megabytes it has not read before the router's writes wait)."""
MAX_SLOW_READS = 60  # the cut comes within a few; a bound on a broken router, not a timing


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(**GREEDY)
    return {t: out.token_ids for t, out in zip(TEXTS, llm.generate(TEXTS, params), strict=True)}


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    config = ServeConfig(
        engine={"kv_cache_memory_mb": 32},
        pools={"prefill": 1, "decode": 1},  # every stream on the one decode worker
        routing={"prefix_routing": False},
        limits={"max_unread_output_kb": BOUND_KB, "slow_client_timeout_s": 120},
        transfer={"lease_s": 120},  # blocks must come back by the abort, not the lease
    )
    deployment = Deployment(config)
    yield deployment
    deployment.stop()


async def _slow_reader(deployment: Deployment) -> tuple[int, grpc.aio.AioRpcError | None]:
    """Read one message a second until the router cut the request, then the
    rest at once; (chunks read, the error the call ended with)."""
    totals = deployment.server.metrics.unread
    async with grpc.aio.insecure_channel(deployment.address, options=SMALL_WINDOW) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        request = build_request(
            TEXTS[0], request_id="slow", temperature=0, max_tokens=1500, ignore_eos=True
        )
        call = stub.Generate(request)
        read = 0
        try:
            while read < MAX_SLOW_READS and not totals.cut:
                if (await call.read()) is grpc.aio.EOF:
                    return read, None
                read += 1
                await asyncio.sleep(1.0)
            while (await call.read()) is not grpc.aio.EOF:
                read += 1
        except grpc.aio.AioRpcError as e:
            return read, e
        return read, None


async def _normal_streams(deployment: Deployment) -> list[list[int]]:
    await asyncio.sleep(0.5)  # the slow stream is under way
    async with TandemClient(deployment.address) as client:
        outs = []
        for _ in range(2):  # while the slow one runs, and after
            outs += await asyncio.gather(*(client.complete(t, **GREEDY) for t in TEXTS))
    return [o.token_ids for o in outs]


def test_a_slow_reader_is_cut_at_the_bound_and_the_other_streams_are_unaffected(
    deployment, reference
):
    async def run():
        return await asyncio.gather(_slow_reader(deployment), _normal_streams(deployment))

    start_free = {n: s.free_blocks for n, s in deployment.worker_stats().items()}
    (read, error), outs = asyncio.run(run())
    assert error is not None, f"the slow stream was not cut ({read} chunks read)"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the client read too slowly" in error.details()
    assert "KB unread" in error.details()
    assert read >= 1
    assert outs == [reference[t] for t in TEXTS] * 2
    totals = deployment.server.metrics.unread
    assert totals.cut == 1 and totals.timed_out == 0
    assert 0 < totals.peak_bytes <= BOUND_KB << 10
    metrics = deployment.server.metrics.render().decode()
    assert f"tandem_unread_output_peak_bytes {float(totals.peak_bytes)}" in metrics
    assert 'tandem_slow_client_requests_total{reason="bound"} 1.0' in metrics
    assert deployment.wait_no_leaks() == {}
    assert {n: s.free_blocks for n, s in deployment.worker_stats().items()} == start_free
    deadline = time.monotonic() + 10  # the router lets the request go once its handler ends
    while totals.bytes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert totals.bytes == 0
