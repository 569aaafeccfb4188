"""The OpenAI-compatible HTTP front: a real RouterServer with its HTTP front
(uvicorn on 127.0.0.1) over a FakeBackend, called with the official openai
SDK: streamed and whole completions and chat completions, models, metrics."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from protos.tandem.v1 import generate_pb2_grpc
from router.client import build_request
from tests.fakes import FakeBackend, FakeTokenizer
from tests.http_helpers import MODEL, metric_samples, sdk, serving

pytestmark = pytest.mark.unit


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


def test_priority_reaches_the_backend_from_both_fronts_and_is_validated():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with serving(backend) as server:
            client = sdk(server)
            await client.completions.create(
                model=MODEL, prompt=[1, 2], max_tokens=1, extra_body={"priority": 7}
            )
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "y"}],
                max_tokens=1,
                extra_body={"priority": -3},
            )
            await client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1)
            for bad in ("high", 1.5, 2**31):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.completions.create(
                        model=MODEL, prompt=[1], max_tokens=1, extra_body={"priority": bad}
                    )
                assert "priority" in str(err.value)
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                async for _ in stub.Generate(build_request([1, 2], max_tokens=1, priority=4)):
                    pass
        assert [i.priority for i in backend.inputs] == [7, -3, 0, 4]

    asyncio.run(body())
