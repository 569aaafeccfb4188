"""The OpenAI-compatible HTTP front: a real RouterServer with its HTTP front
(uvicorn on 127.0.0.1) over a FakeBackend, called with the official openai
SDK and with plain httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.v1 import generate_pb2_grpc
from router.auth import ApiKeys
from router.client import build_request
from router.service import HttpSettings, RouterServer
from tests.fakes import FakeBackend, FakeTokenizer

pytestmark = pytest.mark.unit

MODEL = "fake-model"
KEY = "sk-test-key"


@contextlib.asynccontextmanager
async def serving(
    backend: FakeBackend, keys: tuple[str, ...] = (), **server_kwargs
) -> AsyncIterator[RouterServer]:
    server = RouterServer(
        backend,
        host="127.0.0.1",
        port=0,
        api_keys=ApiKeys(keys),
        http=HttpSettings(host="127.0.0.1", port=0, model_name=MODEL),
        **server_kwargs,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


def sdk(server: RouterServer, key: str = "unused") -> openai.AsyncOpenAI:
    assert server.http is not None
    return openai.AsyncOpenAI(base_url=f"{server.http.url}/v1", api_key=key, max_retries=0)


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_sdk_streams_a_completion_with_usage():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as server:
            client = sdk(server)
            stream = await client.completions.create(
                model=MODEL,
                prompt="hi",
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in stream]
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == " alpha beta gamma"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 3, 5)
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert backend.inputs[0].prompt_token_ids == [104, 105]
        assert backend.finished == [backend.inputs[0].request_id]

    asyncio.run(body())


def test_sdk_streams_a_chat_completion_through_the_fallback_template():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as server:
            stream = await sdk(server).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=2,
                stream=True,
            )
            chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == " alpha beta"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        prompt = bytes(backend.inputs[0].prompt_token_ids).decode()
        assert prompt == "user: hi\nassistant:"

    asyncio.run(body())


def test_whole_responses_carry_usage_and_logprobs():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as server:
            client = sdk(server)
            done = await client.completions.create(
                model=MODEL, prompt=[1, 2, 3], max_tokens=2, logprobs=2
            )
            chat = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": "x"}, {"role": "user", "content": "y"}],
                max_tokens=4,
                logprobs=True,
                top_logprobs=1,
            )
        assert done.choices[0].text == " alpha beta"
        assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 2
        assert done.choices[0].logprobs.token_logprobs == [-0.25, -0.25]
        assert len(done.choices[0].logprobs.top_logprobs[0]) == 2
        assert chat.choices[0].message.content == " alpha beta gamma delta"
        assert chat.choices[0].message.role == "assistant"
        content = chat.choices[0].logprobs.content
        assert len(content) == 4 and len(content[0].top_logprobs) == 1

    asyncio.run(body())


def test_models_health_and_unknown_model():
    async def body():
        async with serving(FakeBackend(tokenizer=FakeTokenizer())) as server:
            client = sdk(server)
            models = await client.models.list()
            assert [m.id for m in models.data] == [MODEL]
            with pytest.raises(openai.NotFoundError) as info:
                await client.completions.create(model="other", prompt="x")
            assert "does not exist" in info.value.message
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                assert (await http.get("/health")).json() == {"status": "ok"}

    asyncio.run(body())


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


def test_metrics_count_requests_of_both_fronts():
    n_http, n_grpc, max_tokens = 3, 2, 4

    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as server:
            client = sdk(server)
            for _ in range(n_http):
                await client.completions.create(model=MODEL, prompt="ab", max_tokens=max_tokens)
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                for _ in range(n_grpc):
                    request = build_request([1, 2, 3], max_tokens=max_tokens)
                    _ = [r async for r in stub.Generate(request)]
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                reply = await http.get("/metrics")
        assert reply.status_code == 200
        s = metric_samples(reply.text)
        requests = {
            dict(labels)["protocol"]: value
            for (name, labels), value in s.items()
            if name == "tandem_requests_total" and dict(labels)["status"] == "OK"
        }
        assert requests == {"http": n_http, "grpc": n_grpc}
        n = n_http + n_grpc
        assert s[("tandem_time_to_first_token_seconds_count", ())] == n
        assert s[("tandem_e2e_request_latency_seconds_count", ())] == n
        assert s[("tandem_time_per_output_token_seconds_count", ())] == n
        assert s[("tandem_inter_token_latency_seconds_count", ())] == n * (max_tokens - 1)
        assert s[("tandem_generation_tokens_total", ())] == n * max_tokens
        assert s[("tandem_prompt_tokens_total", ())] == n_http * 2 + n_grpc * 3
        assert s[("tandem_requests_in_flight", ())] == 0

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
