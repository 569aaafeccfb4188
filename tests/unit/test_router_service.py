"""The router's gRPC service: a real RouterServer on 127.0.0.1 over a FakeBackend,
called with a real grpc.aio client."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc
from router.backend import TokenDelta
from router.client import TandemClient, build_request
from router.service import RouterServer
from tests.fakes import FakeBackend, FakeTokenizer

pytestmark = pytest.mark.unit

WAIT_S = 10.0  # generous upper bound on waits for events; never a timing assertion


@contextlib.asynccontextmanager
async def serving(
    backend: FakeBackend, **server_kwargs
) -> AsyncIterator[tuple[RouterServer, generate_pb2_grpc.TandemStub, grpc.aio.Channel]]:
    server = RouterServer(backend, host="127.0.0.1", port=0, **server_kwargs)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, generate_pb2_grpc.TandemStub(channel), channel
    finally:
        await channel.close()
        await server.stop(0)


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not predicate():
            await asyncio.sleep(0.01)


async def collect(call) -> list[pb.GenerateResponse]:
    return [r async for r in call]


async def error_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(call)
    return info.value


def test_streams_chunks_then_final():
    async def body():
        backend = FakeBackend()
        async with serving(backend) as (server, stub, _):
            request = build_request([1, 2, 3], max_tokens=3, logprobs=2, request_id="r1")
            responses = await collect(stub.Generate(request))
        kinds = [r.WhichOneof("response") for r in responses]
        assert kinds == ["chunk", "chunk", "chunk", "final"]
        assert [r.chunk.text for r in responses[:3]] == [" alpha", " beta", " gamma"]
        assert [list(r.chunk.token_ids) for r in responses[:3]] == [[0], [1], [2]]
        lp = responses[1].chunk.logprobs[0]
        assert lp.token_id == 1 and lp.logprob == -0.25
        assert [t.token_id for t in lp.top_logprobs] == [1, 2]
        final = responses[-1].final
        assert final.request_id == "r1" and final.finish_reason == "length"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 3)
        assert final.timings.prefill_worker == "prefill-0"
        assert final.timings.decode_worker == "decode-0"
        assert backend.finished == ["r1"] and backend.aborted == []
        assert server.service.stats.totals["OK"] == 1
        assert server.service.stats.in_flight == 0

    asyncio.run(body())


def test_text_prompt_is_tokenized_and_unset_fields_take_defaults():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as (_, stub, _):
            await collect(stub.Generate(build_request("hi")))
            await collect(stub.Generate(build_request("hi", temperature=0.0, top_k=-1)))
        first, second = backend.inputs
        assert first.prompt_token_ids == [104, 105]
        assert len(first.request_id) == 32  # a fresh uuid4 hex
        assert first.params.max_tokens == 16
        assert first.params.temperature == 1.0 and first.params.top_p == 1.0
        assert first.params.logprobs is None and first.params.seed is None
        assert second.params.temperature == 0.0 and second.params.top_k == -1

    asyncio.run(body())


INVALID_CASES = [
    # (request keywords, backend keywords, text the message must contain)
    ({}, {}, "prompt is required"),
    ({"prompt": "x", "prompt_token_ids": [1]}, {"tokenizer": FakeTokenizer()}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 256]}, {}, "prompt_token_ids[1] = 256"),
    ({"prompt_token_ids": [-1]}, {}, "prompt_token_ids[0] = -1"),
    ({"prompt_token_ids": [1] * 64}, {}, "prompt_token_ids has 64 tokens; the limit is 63"),
    ({"prompt": "x" * 70}, {"tokenizer": FakeTokenizer()}, "prompt has 70 tokens; the limit is 63"),
    ({"prompt": "hello"}, {}, "prompt text needs a tokenizer"),
    ({"max_tokens": 0}, {}, "max_tokens"),
    ({"temperature": -1.0}, {}, "temperature"),
    ({"temperature": math.nan}, {}, "temperature"),
    ({"top_p": 0.0}, {}, "top_p"),
    ({"top_p": 1.5}, {}, "top_p"),
    ({"top_k": -2}, {}, "top_k"),
    ({"min_p": 2.0}, {}, "min_p"),
    ({"repetition_penalty": 0.0}, {}, "repetition_penalty"),
    ({"frequency_penalty": 3.0}, {}, "frequency_penalty"),
    ({"presence_penalty": -3.0}, {}, "presence_penalty"),
    ({"logprobs": 21}, {}, "logprobs"),
    ({"stop": ["x" * 300]}, {"tokenizer": FakeTokenizer()}, "stop"),
    ({"stop": ["end"]}, {}, "stop strings need a tokenizer"),
    ({"stop_token_ids": [-1]}, {}, "stop_token_ids"),
    ({"stop_token_ids": [300]}, {}, "stop_token_ids must be < vocab_size"),
    ({"request_id": "r" * 300}, {}, "request_id"),
]


@pytest.mark.parametrize(("request_kwargs", "backend_kwargs", "expected"), INVALID_CASES)
def test_invalid_requests_name_the_field(request_kwargs, backend_kwargs, expected):
    async def body():
        backend = FakeBackend(**backend_kwargs)
        request = pb.GenerateRequest(**request_kwargs)
        if "prompt" not in request_kwargs and "prompt_token_ids" not in request_kwargs:
            request.prompt_token_ids.extend([] if request_kwargs == {} else [1, 2])
        async with serving(backend) as (server, stub, _):
            err = await error_of(stub.Generate(request))
            assert server.service.stats.totals["INVALID_ARGUMENT"] == 1
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert expected in err.details()
        assert backend.inputs == []

    asyncio.run(body())


def test_admission_limit_rejects_at_once():
    async def body():
        gate = asyncio.Event()
        backend = FakeBackend(gate=gate)
        async with serving(backend, max_queued_requests=2) as (server, stub, _):
            held = [asyncio.create_task(collect(stub.Generate(build_request([1])))) for _ in "ab"]
            await backend.wait_for(lambda b: len(b.running) == 2)
            err = await error_of(stub.Generate(build_request([1])))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert server.service.stats.in_flight == 2
            gate.set()
            for responses in await asyncio.gather(*held):
                assert responses[-1].final.finish_reason == "length"
            await collect(stub.Generate(build_request([1])))  # room again
            assert server.service.stats.totals == {"OK": 3, "RESOURCE_EXHAUSTED": 1}

    asyncio.run(body())


def test_client_cancel_mid_stream_aborts_the_backend():
    async def body():
        backend = FakeBackend(pause_after=2)
        async with serving(backend) as (server, stub, _):
            call = stub.Generate(build_request([1], max_tokens=10, request_id="c1"))
            received = [await call.read(), await call.read()]
            assert all(r.HasField("chunk") for r in received)
            call.cancel()
            await backend.wait_for(lambda b: "c1" in b.aborted)
            await until(lambda: server.service.stats.in_flight == 0)
            assert server.service.stats.totals["CANCELLED"] == 1
        assert backend.finished == []

    asyncio.run(body())


def test_client_deadline_aborts_the_backend():
    async def body():
        backend = FakeBackend(pause_after=1)
        async with serving(backend) as (server, stub, _):
            call = stub.Generate(build_request([1], request_id="d1"), timeout=0.5)
            err = await error_of(call)
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await backend.wait_for(lambda b: "d1" in b.aborted)
            await until(lambda: server.service.stats.in_flight == 0)

    asyncio.run(body())


def test_server_request_timeout_aborts_the_backend():
    async def body():
        backend = FakeBackend(pause_after=1)
        async with serving(backend, request_timeout_s=0.3) as (server, stub, _):
            err = await error_of(stub.Generate(build_request([1], request_id="t1")))
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "deadline" in err.details()
            assert backend.aborted == ["t1"]
            assert server.service.stats.totals["DEADLINE_EXCEEDED"] == 1

    asyncio.run(body())


def test_duplicate_request_id_in_flight():
    async def body():
        gate = asyncio.Event()
        backend = FakeBackend(gate=gate)
        async with serving(backend) as (_, stub, _):
            first = asyncio.create_task(collect(stub.Generate(build_request([1], request_id="x"))))
            await backend.wait_for(lambda b: "x" in b.running)
            err = await error_of(stub.Generate(build_request([2], request_id="x")))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "request_id" in err.details()
            gate.set()
            assert (await first)[-1].final.request_id == "x"
            again = await collect(stub.Generate(build_request([1], request_id="x")))
            assert again[-1].final.request_id == "x"  # free once the first finished

    asyncio.run(body())


@pytest.mark.parametrize("fake", [{"fail_after": 2}, {"end_without_result": True}])
def test_backend_failure_is_internal(fake):
    async def body():
        backend = FakeBackend(**fake)
        async with serving(backend) as (server, stub, _):
            err = await error_of(stub.Generate(build_request([1], max_tokens=4)))
            assert err.code() == grpc.StatusCode.INTERNAL
            assert "generation failed" in err.details()
            assert server.service.stats.totals["INTERNAL"] == 1

    asyncio.run(body())


def test_oversized_message_gets_a_clean_error():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend, max_message_bytes=1 << 20) as (_, stub, _):
            err = await error_of(stub.Generate(build_request("x" * (2 << 20))))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert backend.inputs == []

    asyncio.run(body())


def test_reflection_lists_the_services():
    async def body():
        async with serving(FakeBackend()) as (_, _, channel):
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = [s.name async for r in call for s in r.list_services_response.service]
        assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= set(names)

    asyncio.run(body())


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return reply.status


def test_health_and_unavailable_while_starting():
    async def body():
        start_gate = asyncio.Event()
        backend = FakeBackend(start_gate=start_gate)
        server = RouterServer(backend, host="127.0.0.1", port=0)
        starting = asyncio.create_task(server.start())
        await until(lambda: server.port != 0)
        async with grpc.aio.insecure_channel(server.address) as channel:
            async with asyncio.timeout(WAIT_S):
                await channel.channel_ready()  # bound and serving while the backend starts
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            stub = generate_pb2_grpc.TandemStub(channel)
            err = await error_of(stub.Generate(build_request([1])))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            start_gate.set()
            await starting
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert (
                await _health(channel, "tandem.v1.Tandem") == health_pb2.HealthCheckResponse.SERVING
            )
        await server.stop(0)
        assert backend.shut_down

    asyncio.run(body())


def test_graceful_stop_lets_in_flight_streams_finish():
    async def body():
        gate = asyncio.Event()
        backend = FakeBackend(gate=gate)
        async with serving(backend) as (server, stub, channel):
            assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
            in_flight = asyncio.create_task(collect(stub.Generate(build_request([1]))))
            await backend.wait_for(lambda b: len(b.running) == 1)
            stopping = asyncio.create_task(server.stop(WAIT_S))
            await until(lambda: server.service.unavailable is not None)
            assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            err = await error_of(stub.Generate(build_request([1])))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert not stopping.done()
            gate.set()
            responses = await in_flight
            assert responses[-1].final.finish_reason == "length"
            await stopping
        assert backend.shut_down and len(backend.finished) == 1

    asyncio.run(body())


def test_stop_after_grace_cancels_what_is_left():
    async def body():
        backend = FakeBackend(gate=asyncio.Event())
        async with serving(backend) as (server, stub, _):
            call = stub.Generate(build_request([1], request_id="late"))
            await backend.wait_for(lambda b: "late" in b.running)
            await server.stop(0.2)
            err = await error_of(call)
            assert err.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            assert backend.aborted == ["late"]

    asyncio.run(body())


def test_client_complete_and_early_exit():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), pause_after=3)
        async with (
            serving(backend) as (server, _, _),
            TandemClient(server.address, timeout_s=WAIT_S) as client,
        ):
            backend.resume.set()
            done = await client.complete("hey", max_tokens=5, stop="!", logprobs=0)
            assert done.text == " alpha beta gamma delta alpha"
            assert done.token_ids == [0, 1, 2, 3, 4]
            assert done.finish_reason == "length" and done.usage.prompt_tokens == 3
            assert len(done.logprobs) == 5 and not done.logprobs[0].top_logprobs
            assert backend.inputs[-1].params.stop == ["!"]

            backend.resume.clear()
            stream = client.generate([1], max_tokens=10, request_id="early")
            async for _ in stream:
                break
            await stream.aclose()
            await backend.wait_for(lambda b: "early" in b.aborted)

    asyncio.run(body())


def test_build_request_rejects_unknown_keywords():
    with pytest.raises(TypeError, match="temprature"):
        build_request("x", temprature=0.5)
    with pytest.raises(TypeError, match="prompt"):
        build_request(3.5)  # type: ignore[arg-type]


def test_a_timeout_inside_the_backend_is_internal_not_a_deadline():
    class SlowRayCall(FakeBackend):
        async def _generate(self, inp):
            yield TokenDelta([1], "x")
            raise TimeoutError("ray call timed out")

    async def body():
        async with serving(SlowRayCall()) as (_, stub, _):
            err = await error_of(stub.Generate(build_request([1])))
        assert err.code() == grpc.StatusCode.INTERNAL
        assert err.details() == "generation failed: TimeoutError: ray call timed out"

    asyncio.run(body())
