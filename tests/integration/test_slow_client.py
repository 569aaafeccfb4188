"""A client that reads one message a second while other streams run on the
same decode worker (local Ray, the embedded tiny model, real gRPC).

The slow request is cut once its unread output in the router reaches
``limits.max_unread_output_kb`` (held up to near the bound, as exported in
``tandem_unread_output_peak_bytes``, not cut early); it ends with
RESOURCE_EXHAUSTED after the chunks already sent to it, which are the
engine's own first tokens, none lost or repeated; the other streams' outputs
equal the engine alone; every worker's free blocks come back to their start.
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


SLOW_MAX_TOKENS = 1500  # far more than the bound lets the router hold


@pytest.fixture(scope="module")
def llm():
    return LLM(None, kv_cache_memory_bytes=32 << 20)


@pytest.fixture(scope="module")
def reference(llm):
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


async def _slow_reader(
    deployment: Deployment,
) -> tuple[int, list[int], grpc.aio.AioRpcError | None]:
    """Read one message a second until the router cut the request, then the
    rest at once; (messages read, their token ids, the error the call ended with)."""
    totals = deployment.server.metrics.unread
    async with grpc.aio.insecure_channel(deployment.address, options=SMALL_WINDOW) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        request = build_request(
            TEXTS[0], request_id="slow", temperature=0, max_tokens=SLOW_MAX_TOKENS, ignore_eos=True
        )
        call = stub.Generate(request)
        read, tokens = 0, []

        async def one() -> bool:
            nonlocal read
            response = await call.read()
            if response is grpc.aio.EOF:
                return False
            read += 1
            tokens.extend(response.chunk.token_ids)
            return True

        try:
            while read < MAX_SLOW_READS and not totals.cut:
                if not await one():
                    return read, tokens, None
                await asyncio.sleep(1.0)
            while await one():
                pass
        except grpc.aio.AioRpcError as e:
            return read, tokens, e
        return read, tokens, None


async def _normal_streams(deployment: Deployment) -> list[list[int]]:
    await asyncio.sleep(0.5)  # the slow stream is under way
    async with TandemClient(deployment.address) as client:
        outs = []
        for _ in range(2):  # while the slow one runs, and after
            outs += await asyncio.gather(*(client.complete(t, **GREEDY) for t in TEXTS))
    return [o.token_ids for o in outs]


def test_a_slow_reader_is_cut_at_the_bound_and_the_other_streams_are_unaffected(
    deployment, reference, llm
):
    async def run():
        return await asyncio.gather(_slow_reader(deployment), _normal_streams(deployment))

    start_free = {n: s.free_blocks for n, s in deployment.worker_stats().items()}
    (read, tokens, error), outs = asyncio.run(run())
    assert error is not None, f"the slow stream was not cut ({read} chunks read)"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the client read too slowly" in error.details()
    assert "KB unread" in error.details()
    assert read >= 1
    assert outs == [reference[t] for t in TEXTS] * 2
    totals = deployment.server.metrics.unread
    assert totals.cut == 1 and totals.timed_out == 0
    # What the client got before the cut: the engine's own first tokens (none
    # lost or repeated), far fewer than the request asked for.
    assert 0 < len(tokens) < SLOW_MAX_TOKENS
    alone = SamplingParams(temperature=0, max_tokens=len(tokens), ignore_eos=True)
    assert tokens == llm.generate([TEXTS[0]], alone)[0].token_ids
    # The router held the output up to near the bound before cutting (one
    # delta of the tiny model is tens of bytes), not at the first delta.
    assert totals.peak_bytes >= (BOUND_KB << 10) // 2
    metrics = deployment.server.metrics.render().decode()
    assert f"tandem_unread_output_peak_bytes {float(totals.peak_bytes)}" in metrics
    assert 'tandem_slow_client_requests_total{reason="bound"} 1.0' in metrics
    assert deployment.wait_no_leaks() == {}
    assert {n: s.free_blocks for n, s in deployment.worker_stats().items()} == start_free
    deadline = time.monotonic() + 10  # the router lets the request go once its handler ends
    while totals.bytes and time.monotonic() < deadline:
        time.sleep(0.1)
    assert totals.bytes == 0
