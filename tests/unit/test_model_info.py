"""What model is served and its limits: GetModelInfo on the gRPC API and
/v1/models on the HTTP front, against a real RouterServer over a FakeBackend
of 8,000 tokens."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import httpx
import pytest

from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc
from router.client import TandemClient
from router.lifecycle import STARTING
from router.model_info import ModelInfo
from router.service import RouterServer
from tandem_cli import serve
from tests.fakes import FakeBackend, FakeTokenizer
from tests.http_helpers import KEY, MODEL, serving

pytestmark = pytest.mark.unit

VOCAB, CONTEXT = 8000, 4096
WAIT_S = 10.0  # an upper bound on waits for events; never a timing assertion


def fake(**kwargs) -> FakeBackend:
    """The user's report: a model of 8,000 tokens (the old bench drew ids up to 30,000)."""
    return FakeBackend(vocab_size=VOCAB, max_model_len=CONTEXT, block_size=32, delay_s=0, **kwargs)


EXPECTED = ModelInfo(
    name=MODEL, vocab_size=VOCAB, max_model_len=CONTEXT, has_tokenizer=False, block_size=32
)


def test_get_model_info_gives_the_backend_figures_and_needs_the_key():
    async def body():
        async with serving(fake(), keys=(KEY,)) as server:
            async with TandemClient(server.address, api_key=KEY) as client:
                assert await client.model_info() == EXPECTED
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                for metadata in ((), (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(body())


def test_get_model_info_is_unavailable_while_starting():
    async def body():
        backend = fake(start_gate=asyncio.Event())
        server = RouterServer(backend, host="127.0.0.1", port=0)
        starting = asyncio.create_task(server.start())
        async with asyncio.timeout(WAIT_S):
            while server.port == 0:
                await asyncio.sleep(0.01)
        async with TandemClient(server.address) as client:
            async with asyncio.timeout(WAIT_S):
                await client._channel.channel_ready()  # listening, still starting
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.model_info()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == STARTING
            backend.start_gate.set()
            await starting
            assert await client.model_info() == EXPECTED
        await server.stop(0)

    asyncio.run(body())


def test_v1_models_carries_the_same_figures():
    async def body():
        async with serving(fake(tokenizer=FakeTokenizer()), keys=(KEY,)) as server:
            headers = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                assert (await http.get("/v1/models")).status_code == 401
                reply = await http.get("/v1/models", headers=headers)
        (card,) = reply.json()["data"]
        assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "tandem"
        assert card["max_model_len"] == CONTEXT and card["vocab_size"] == VOCAB
        assert card["has_tokenizer"] is True and card["block_size"] == 32
        assert ModelInfo.from_card(card) == dataclasses.replace(EXPECTED, has_tokenizer=True)

    asyncio.run(body())


def test_ray_backend_names_the_model_as_the_http_front_does():
    from router.ray_backend import RayBackend
    from tandem_cli.config import ServeConfig

    assert RayBackend(ServeConfig()).model_name == "tandem-tiny-llama"
    backend = RayBackend(ServeConfig(model="/m/x", block_size=32))
    assert (backend.model_name, backend.block_size) == ("/m/x", 32)
    named = ServeConfig(model="/m/x", served_model_name="m", http_port=0)
    assert RayBackend(named).model_name == "m" == serve.http_settings(named).model_name
