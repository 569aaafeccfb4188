"""The HTTP front's refusals and failure paths: bad input (400), API keys
(401, and UNAUTHENTICATED on gRPC), conflicts (409), admission (429),
starting (503), deadlines (504), failures and disconnects mid-request."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest

from protos.tandem.v1 import generate_pb2_grpc
from router.client import build_request
from router.service import HttpSettings, RouterServer
from tests.fakes import FakeBackend, FakeTokenizer
from tests.http_helpers import KEY, MODEL, metric_samples, sdk, serving

pytestmark = pytest.mark.unit


BAD_BODIES = [
    # (endpoint, body, text the error message must contain)
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 2}, "n:"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, "one prompt"),
    ("completions", {"model": MODEL}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x" * 70}, "prompt has 70 tokens"),
    ("completions", {"model": MODEL, "prompt": [999]}, "outside the vocabulary"),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, "role"),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs needs logprobs",
    ),
]


@pytest.mark.parametrize(("endpoint", "payload", "expected"), BAD_BODIES)
def test_bad_input_gets_400_in_openai_error_shape(endpoint, payload, expected):
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as server:
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                reply = await http.post(f"/v1/{endpoint}", json=payload)
                bad_json = await http.post("/v1/completions", content=b"{not json")
            metrics = server.metrics.render().decode()
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert expected in error["message"]
        assert (
            bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
        )
        assert backend.inputs == []
        samples = metric_samples(metrics)
        key = ("tandem_requests_total", (("protocol", "http"), ("status", "INVALID_ARGUMENT")))
        assert samples[key] == 2

    asyncio.run(body())


def test_api_keys_guard_both_fronts_but_not_health():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend, keys=(KEY, "another")) as server:
            for key in ("wrong", None):
                headers = {"authorization": f"Bearer {key}"} if key else {}
                async with httpx.AsyncClient(base_url=server.http.url, headers=headers) as http:
                    reply = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                    assert reply.status_code == 401
                    assert reply.json()["error"]["type"] == "authentication_error"
                    assert (await http.get("/v1/models")).status_code == 401
                    assert (await http.get("/health")).status_code == 200
            with pytest.raises(openai.AuthenticationError):
                await sdk(server, "wrong").completions.create(model=MODEL, prompt="x")
            done = await sdk(server, KEY).completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert done.choices[0].text == " alpha"

            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                for metadata in ((), (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        _ = [r async for r in stub.Generate(build_request([1]), metadata=metadata)]
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                good = (("authorization", f"Bearer {KEY}"),)
                responses = [r async for r in stub.Generate(build_request([1]), metadata=good)]
                assert responses[-1].final.finish_reason == "length"
            samples = metric_samples(server.metrics.render().decode())
        assert len(backend.inputs) == 2  # the refused calls never reached the backend
        unauth = "UNAUTHENTICATED"
        assert samples[("tandem_requests_total", (("protocol", "grpc"), ("status", unauth)))] == 2
        assert samples[("tandem_requests_total", (("protocol", "http"), ("status", unauth)))] == 3

    asyncio.run(body())


def test_disconnect_mid_stream_aborts_the_backend():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), pause_after=2)
        async with serving(backend) as server:
            payload = {"model": MODEL, "prompt": "x", "max_tokens": 10, "stream": True}
            headers = {"x-request-id": "h1"}
            async with (
                httpx.AsyncClient(base_url=server.http.url) as http,
                http.stream("POST", "/v1/completions", json=payload, headers=headers) as reply,
            ):
                lines = reply.aiter_lines()
                got = 0
                async for line in lines:
                    got += line.startswith("data: ")
                    if got == 2:
                        break
            await backend.wait_for(lambda b: "h1" in b.aborted)
            async with asyncio.timeout(10):
                while server.lifecycle.stats.in_flight:
                    await asyncio.sleep(0.01)
            assert server.lifecycle.stats.totals["CANCELLED"] == 1
        assert backend.finished == []

    asyncio.run(body())


def test_failure_mid_stream_is_an_error_event():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), fail_after=1)
        async with serving(backend) as server:
            payload = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                reply = await http.post("/v1/completions", json=payload)
            with pytest.raises(openai.APIError):
                stream = await sdk(server).completions.create(
                    model=MODEL, prompt="x", max_tokens=5, stream=True
                )
                _ = [c async for c in stream]
            assert server.lifecycle.stats.totals["INTERNAL"] == 2
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "scripted backend failure" in error["message"] and error["code"] == "internal"

    asyncio.run(body())


def test_a_taken_http_port_fails_the_start_and_leaves_nothing_running():
    async def body():
        import socket

        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            backend = FakeBackend()
            server = RouterServer(
                backend,
                host="127.0.0.1",
                port=0,
                http=HttpSettings(host="127.0.0.1", port=port, model_name=MODEL),
            )
            with pytest.raises(OSError):
                await server.start()
            assert backend.shut_down and not backend.started
            await server.stop(0)  # a no-op after a failed start

    asyncio.run(body())


def test_admission_limit_and_request_id_conflict():
    async def body():
        gate = asyncio.Event()
        backend = FakeBackend(tokenizer=FakeTokenizer(), gate=gate)
        payload = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        same = {"x-request-id": "same"}
        async with (
            serving(backend, max_queued_requests=2) as server,
            httpx.AsyncClient(base_url=server.http.url, timeout=30) as http,
        ):
            held = asyncio.create_task(http.post("/v1/completions", json=payload, headers=same))
            await backend.wait_for(lambda b: len(b.running) == 1)
            dup = await http.post("/v1/completions", json=payload, headers=same)
            assert dup.status_code == 409 and "already running" in dup.json()["error"]["message"]
            busy = asyncio.create_task(http.post("/v1/completions", json=payload))
            await backend.wait_for(lambda b: len(b.running) == 2)
            full = await http.post("/v1/completions", json=payload)
            assert full.status_code == 429
            assert full.json()["error"]["type"] == "rate_limit_error"
            gate.set()
            assert (await held).status_code == 200 and (await busy).status_code == 200
        totals = server.lifecycle.stats.totals
        assert totals == {"OK": 2, "ALREADY_EXISTS": 1, "RESOURCE_EXHAUSTED": 1}

    asyncio.run(body())


def test_request_timeout_is_504_or_an_error_event_and_aborts():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), pause_after=1)
        async with serving(backend, request_timeout_s=0.3) as server:
            async with httpx.AsyncClient(base_url=server.http.url, timeout=30) as http:
                payload = {"model": MODEL, "prompt": "x", "max_tokens": 5}
                whole = await http.post(
                    "/v1/completions", json=payload, headers={"x-request-id": "w"}
                )
                streamed = await http.post(
                    "/v1/completions",
                    json={**payload, "stream": True},
                    headers={"x-request-id": "s"},
                )
            await backend.wait_for(lambda b: {"w", "s"} <= set(b.aborted))
            assert server.lifecycle.stats.totals["DEADLINE_EXCEEDED"] == 2
        assert whole.status_code == 504 and "deadline" in whole.json()["error"]["message"]
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["text"] == " alpha"
        assert json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
        assert events[-1] == "[DONE]"

    asyncio.run(body())


def test_health_is_503_while_starting():
    async def body():
        start_gate = asyncio.Event()
        backend = FakeBackend(tokenizer=FakeTokenizer(), start_gate=start_gate)
        server = RouterServer(
            backend,
            host="127.0.0.1",
            port=0,
            http=HttpSettings(host="127.0.0.1", port=0, model_name=MODEL),
        )
        starting = asyncio.create_task(server.start())
        try:
            async with asyncio.timeout(10):
                while server.http.port == 0:
                    await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                assert (await http.get("/health")).status_code == 503
                payload = {"model": MODEL, "prompt": "x"}
                assert (await http.post("/v1/completions", json=payload)).status_code == 503
                start_gate.set()
                await starting
                assert (await http.get("/health")).status_code == 200
        finally:
            start_gate.set()
            await starting
            await server.stop(0)

    asyncio.run(body())


def test_disconnect_before_a_whole_answer_aborts_the_backend():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), pause_after=1)
        async with serving(backend) as server:
            payload = {"model": MODEL, "prompt": "x", "max_tokens": 5}
            async with httpx.AsyncClient(base_url=server.http.url, timeout=0.5) as http:
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
                    await http.post("/v1/completions", json=payload, headers={"x-request-id": "n1"})
            await backend.wait_for(lambda b: "n1" in b.aborted)
            async with asyncio.timeout(10):
                while server.lifecycle.stats.in_flight:
                    await asyncio.sleep(0.01)
            assert server.lifecycle.stats.totals["CANCELLED"] == 1
        assert backend.finished == []

    asyncio.run(body())
