"""A request's unread output in the router: exact counts from a delta's
arrival until the client accepted it, a slow reader's deltas folded into one
chunk, the bound (the request is cut at once), and the write timeout behind
the real gRPC server and HTTP front."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest

from protos.tandem.v1 import generate_pb2, generate_pb2_grpc, worker_pb2
from router.backpressure import SlowClient, UnreadOutput, UnreadTotals
from router.client import build_request
from router.limits import RequestLimits
from router.worker_streams import CUT, LOST, DeltaQueue, merge_queued
from tests.fakes import FakeBackend, FakeTokenizer
from tests.http_helpers import MODEL
from tests.http_helpers import serving as http_serving
from tests.unit.test_router_service import serving, until

pytestmark = pytest.mark.unit


def _delta(tokens: list[int], text: str, **end) -> worker_pb2.RequestDelta:
    return worker_pb2.RequestDelta(
        request_id="r",
        token_ids=tokens,
        text=text,
        logprobs=[generate_pb2.TokenLogprob(token_id=t, logprob=-0.5) for t in tokens],
        **end,
    )


def _size(*deltas: worker_pb2.RequestDelta) -> int:
    return sum(d.ByteSize() for d in deltas)


def test_a_delta_counts_from_its_arrival_until_the_client_accepted_it():
    totals = UnreadTotals()
    unread = UnreadOutput(max_bytes=1 << 20, totals=totals)
    queue = DeltaQueue(unread)
    a, b = _delta([1, 2], "ab"), _delta([3], "c")
    queue.put(a)
    queue.put(b)
    assert (unread.bytes, unread.tokens) == (_size(a, b), 3)
    assert totals.bytes == _size(a, b) == totals.peak_bytes
    taken = queue.get_nowait()  # being written: still held
    assert taken is a and unread.bytes == _size(a, b)
    queue.written()
    assert (unread.bytes, unread.tokens) == (_size(b), 1)
    queue.close()  # the try ended with b queued
    assert (unread.bytes, unread.tokens, totals.bytes) == (0, 0, 0)
    assert totals.peak_bytes == unread.peak_bytes == _size(a, b)
    queue.put(_delta([4], "d"))  # after close: nobody's
    assert unread.bytes == 0 and queue.empty()


def test_a_slow_reader_gets_one_chunk_of_everything_queued_still_counted_until_written():
    unread = UnreadOutput(max_bytes=1 << 20)
    queue = DeltaQueue(unread)
    deltas = [_delta([i], chr(97 + i)) for i in range(5)]
    for d in deltas:
        queue.put(d)
    total = _size(*deltas)
    chunk = merge_queued(queue.get_nowait(), queue)
    assert list(chunk.token_ids) == [0, 1, 2, 3, 4] and chunk.text == "abcde"
    assert [lp.token_id for lp in chunk.logprobs] == [0, 1, 2, 3, 4]
    assert queue.empty() and (unread.bytes, unread.tokens) == (total, 5)
    queue.written()
    assert (unread.bytes, unread.tokens) == (0, 0)


def test_past_the_bound_the_queue_is_dropped_cut_queued_and_the_backend_told_once():
    cuts: list[int] = []
    deltas = [_delta([i, i + 1], "xy" * 8) for i in range(4)]
    totals = UnreadTotals()
    bound = _size(*deltas[:3])
    unread = UnreadOutput(max_bytes=bound, totals=totals)
    queue = DeltaQueue(unread, on_cut=lambda: cuts.append(unread.bytes))
    queue.put(deltas[0])
    assert queue.get_nowait() is deltas[0]  # in the write, counted
    queue.put(deltas[1])
    queue.put(deltas[2])
    assert unread.bytes == bound and unread.cut is None  # at the bound, not past it
    queue.put(deltas[3])
    assert unread.cut is not None and cuts == [_size(deltas[0])]  # the queued two dropped
    assert f"{(bound + _size(deltas[3])) / 1024:.1f} KB unread" in unread.cut
    assert "limits.max_unread_output_kb" in unread.cut
    assert not queue.next_is_delta() and queue.get_nowait() is CUT and queue.empty()
    queue.put(_delta([9], "z"))  # the worker's later steps are dropped as they come
    assert queue.empty() and cuts == [_size(deltas[0])] and totals.cut == 1
    assert unread.peak_bytes == bound == totals.peak_bytes
    queue.close()
    assert unread.bytes == totals.bytes == 0


def test_a_handler_waiting_for_a_delta_wakes_on_cut_and_on_lost():
    async def body():
        for kind in ("cut", "lost"):
            unread = UnreadOutput(max_bytes=8)  # smaller than any delta
            queue = DeltaQueue(unread)
            waiter = asyncio.ensure_future(queue.get())
            await asyncio.sleep(0)
            queue.put(_delta([1], "a")) if kind == "cut" else queue.put_lost()
            got = await asyncio.wait_for(waiter, 5)
            assert got is (CUT if kind == "cut" else LOST)
            assert unread.bytes == 0

    asyncio.run(body())


def test_a_write_the_client_does_not_accept_in_time_is_a_slow_client():
    async def body():
        totals = UnreadTotals()
        unread = UnreadOutput(max_bytes=1 << 20, write_timeout_s=0.05, totals=totals)
        async with unread.writing():
            await asyncio.sleep(0)  # accepted
        never = asyncio.Event()
        with pytest.raises(SlowClient, match=r"accepted no output for 0.05 s"):
            async with unread.writing():
                await never.wait()
        assert totals.timed_out == 1 and "limits.slow_client_timeout_s" in str(unread.cut)

    asyncio.run(body())


def test_an_outer_deadline_is_not_taken_for_a_slow_client():
    async def body():
        unread = UnreadOutput(write_timeout_s=60.0)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01), unread.writing():
                await asyncio.Event().wait()
        assert unread.cut is None and unread.totals.timed_out == 0

    asyncio.run(body())


SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
"""A client's HTTP/2 window of 1 KiB: its transport takes 1 KiB it has not read."""


def test_a_grpc_client_that_stops_reading_gets_resource_exhausted_and_the_request_is_aborted():
    async def body():
        backend = FakeBackend(max_model_len=1 << 20, words=("w" * 500,), delay_s=0)
        limits = RequestLimits(slow_client_timeout_s=0.2)
        async with serving(backend, limits=limits) as (server, _, _):
            channel = grpc.aio.insecure_channel(server.address, options=SMALL_WINDOW)

            stub = generate_pb2_grpc.TandemStub(channel)
            call = stub.Generate(build_request([1], max_tokens=100_000, request_id="slow"))
            assert (await call.read()).HasField("chunk")  # then it reads nothing
            await backend.wait_for(lambda b: "slow" in b.aborted)
            await until(lambda: server.service.stats.totals["RESOURCE_EXHAUSTED"] == 1)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the client read too slowly" in info.value.details()
            assert server.metrics.unread.timed_out == 1 and server.metrics.unread.bytes == 0
            text = server.metrics.render().decode()
            assert 'tandem_slow_client_requests_total{reason="timeout"} 1.0' in text
            await channel.close()
        assert backend.finished == []

    asyncio.run(body())


def test_an_sse_client_that_stops_reading_is_closed_and_the_request_aborted():
    async def body():
        backend = FakeBackend(
            tokenizer=FakeTokenizer(), max_model_len=1 << 20, words=("w" * 4000,), delay_s=0
        )
        limits = RequestLimits(slow_client_timeout_s=0.2)
        async with http_serving(backend, limits=limits) as server:
            assert server.http is not None
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", server.http.port))
            payload = json.dumps(
                {"model": MODEL, "prompt": "x", "max_tokens": 100_000, "stream": True}
            )
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"x-request-id: sse-slow\r\ncontent-length: %d\r\n\r\n%s"
                % (len(payload), payload.encode())
            )  # then it reads nothing
            try:
                await backend.wait_for(lambda b: "sse-slow" in b.aborted)
                await until(lambda: server.lifecycle.stats.totals["RESOURCE_EXHAUSTED"] == 1)
                assert server.metrics.unread.timed_out == 1
            finally:
                sock.close()
        assert backend.finished == []

    asyncio.run(body())
