"""Bounded ingress on both fronts: body size (413), Generate message size, stop
strings, prompt bytes before tokenizing, out-of-range numbers, requests in
flight per API key, and request ids that cannot forge log lines."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from tokenizers import Tokenizer, models

from engine.detokenizer import IncrementalDetokenizer, StopMatcher, StopMatcherCache
from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc
from router.config import ServeConfig
from router.limits import (
    FALLBACK_BYTES_PER_TOKEN,
    TRANSPORT_BYTES_PER_TOKEN,
    RequestLimits,
    prompt_byte_limit,
)
from router.service import RouterServer
from router.tokenizer import RouterTokenizer
from tandem_cli.serve import transport_message_limit
from tests.fakes import FakeBackend, FakeTokenizer
from tests.http_helpers import MODEL, serving
from worker.logfmt import format_fields

pytestmark = pytest.mark.unit

WAIT_S = 10.0  # an upper bound on waits for events, never a timing assertion


class CountingTokenizer(FakeTokenizer):
    """FakeTokenizer that counts the texts it was asked to encode."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


@contextlib.asynccontextmanager
async def fronts(
    backend: FakeBackend, keys: tuple[str, ...] = (), **kwargs
) -> AsyncIterator[tuple[RouterServer, httpx.AsyncClient, generate_pb2_grpc.TandemStub]]:
    async with (
        serving(backend, keys, **kwargs) as server,
        httpx.AsyncClient(base_url=server.http.url, timeout=30) as http,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        yield server, http, generate_pb2_grpc.TandemStub(channel)


async def grpc_error(stub, request: pb.GenerateRequest, key: str | None = None):
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _ = [r async for r in stub.Generate(request, metadata=metadata)]
    return info.value


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "x", "max_tokens": 2} | fields


# -- HTTP body size ----------------------------------------------------------------


async def _raw_post(port: int, head: str, body: bytes = b"") -> bytes:
    """Sends a request by hand (a Content-Length that lies is possible) and reads the
    status line and headers of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        async with asyncio.timeout(WAIT_S):  # a server waiting for the body never answers
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


def test_a_body_past_the_limit_is_413_by_length_or_by_count():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        limits = RequestLimits(max_http_body_bytes=1024)
        async with fronts(backend, limits=limits) as (server, http, _):
            head = (
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {100 << 20}\r\n\r\n"
            )
            declared = await _raw_post(server.http.port, head)  # 100 MB announced, none sent

            head = (
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                "transfer-encoding: chunked\r\n\r\n"
            )
            chunk = b"200\r\n" + b" " * 512 + b"\r\n"  # 512 bytes; no final chunk is sent
            chunked = await _raw_post(server.http.port, head, chunk * 3)
            small = await http.post(
                "/v1/completions", content=b'{"model": "%s", "prompt": "x"}' % MODEL.encode()
            )
            still = await http.post("/v1/completions", json=completion())
        assert declared.startswith(b"HTTP/1.1 413")
        assert chunked.startswith(b"HTTP/1.1 413")
        assert small.status_code == 200 and still.status_code == 200
        assert len(backend.inputs) == 2

    asyncio.run(body())


# -- gRPC message size -----------------------------------------------------------------


def test_generate_requests_bigger_than_the_model_can_use_are_refused_unparsed():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), max_model_len=64)
        async with fronts(backend) as (server, _, stub):
            limit = server.generate_message_limit()
            big = pb.GenerateRequest(prompt_token_ids=[2**30] * (limit // 5 + 1), max_tokens=1)
            refused = await grpc_error(stub, big)
            ok = [r async for r in stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2]))]
        assert limit < 64 << 20  # what max_model_len needs, not the transport's cap
        assert big.ByteSize() > limit
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_model_len" in refused.details()
        assert ok[-1].HasField("final") and len(backend.inputs) == 1

    asyncio.run(body())


# -- stop strings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(["a", "b", "c"], "at most 2 stop strings"), (["abcde", "éèà"], "at most 8 bytes")],
)
def test_stop_strings_are_bounded_in_count_and_bytes_on_both_fronts(stop, expected):
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        limits = RequestLimits(max_stop_strings=2, max_stop_bytes=8)
        async with fronts(backend, limits=limits) as (_, http, stub):
            reply = await http.post("/v1/completions", json=completion(stop=stop))
            error = await grpc_error(stub, pb.GenerateRequest(prompt="x", stop=stop))
            fits = await http.post("/v1/completions", json=completion(stop=["abcd", "éè"]))
        assert reply.status_code == 400 and expected in reply.json()["error"]["message"]
        assert reply.json()["error"]["message"].startswith("stop")
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in error.details()
        assert fits.status_code == 200
        assert [i.params.stop for i in backend.inputs] == [["abcd", "éè"]]

    asyncio.run(body())


def test_stop_matcher_cache_is_bounded_in_bytes():
    one = StopMatcher(["abcdefgh"])
    cache = StopMatcherCache(max_bytes=3 * one.nbytes)
    first = cache.get(("abcdefgh",))
    for stop in ("bcdefghi", "cdefghij", "defghijk"):
        cache.get((stop,))
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert cache.get(("abcdefgh",)) is not first  # the least recently used went first
    assert cache.get(("abcdefgh",)) is cache.get(("abcdefgh",))
    huge = StopMatcherCache(max_bytes=one.nbytes - 1)
    assert huge.get(("abcdefgh",)).match_len and len(huge) == 0  # used, never kept


class ByteTokenizer(FakeTokenizer):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return super().decode(token_ids)


def test_the_detokenizer_uses_the_matcher_its_caller_built():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["zz"], matcher=StopMatcher(["ab"]))
    text = "".join(detok.add(t).text_delta for t in b"xxab")
    assert detok.stopped and text == "xx"


# -- prompt bytes before tokenizing -----------------------------------------------


def test_prompts_longer_than_max_model_len_can_encode_are_refused_untokenized():
    async def body():
        tokenizer = CountingTokenizer()
        backend = FakeBackend(tokenizer=tokenizer, max_model_len=64)
        limit = 64 * FALLBACK_BYTES_PER_TOKEN
        long = "é" * (limit // 2 + 1)  # two bytes each: one char fewer than the limit would fit
        async with fronts(backend) as (_, http, stub):
            text = await http.post("/v1/completions", json=completion(prompt=long))
            chat = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": long}]},
            )
            parts = [{"type": "text", "text": long[: len(long) // 2]}] * 3
            split = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": parts}]},
            )
            error = await grpc_error(stub, pb.GenerateRequest(prompt=long))
        for reply, field in ((text, "prompt"), (chat, "messages"), (split, "messages")):
            assert reply.status_code == 400, reply.text
            message = reply.json()["error"]["message"]
            assert message.startswith(field) and f"longer than {limit} bytes" in message
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is longer" in (
            error.details()
        )
        assert tokenizer.encoded == 0 and backend.inputs == []

    asyncio.run(body())


def test_the_byte_bound_of_a_real_tokenizer_is_its_longest_token():
    vocab = {"[UNK]": 0, "a": 1, "hello": 2, "héllo": 3}
    tokenizer = RouterTokenizer(Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))
    assert tokenizer.max_token_bytes == 6
    assert prompt_byte_limit(tokenizer, 100) == 600


# -- out-of-range numbers, odd text -----------------------------------------------------

OUT_OF_RANGE = [
    ("completions", {"max_tokens": 2**64}, "max_tokens"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"seed": 2**70}, "seed"),
    ("completions", {"top_k": 2**40}, "top_k"),
    ("completions", {"logprobs": 10**6}, "logprobs"),
    ("completions", {"n": 2**70}, "n"),
    ("completions", {"prompt": [2**40]}, "prompt"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"temperature": 1e39}, "temperature"),
    ("completions", {"prompt": "\ud800"}, "surrogate"),
    ("chat/completions", {"max_completion_tokens": 2**64}, "max_completion_tokens"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
]


@pytest.mark.parametrize(("endpoint", "fields", "named"), OUT_OF_RANGE)
def test_out_of_range_fields_are_400_naming_the_field(endpoint, fields, named):
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        base = {"model": MODEL, "max_tokens": 2}
        base |= (
            {"prompt": "x"}
            if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "x"}]}
        )
        async with fronts(backend) as (_, http, _stub):
            raw = json.dumps(base | fields).encode()  # ASCII: a lone surrogate escaped
            reply = await http.post(f"/v1/{endpoint}", content=raw)
            nan = await http.post(
                "/v1/completions",
                content=b'{"model": "%s", "prompt": "x", "top_p": NaN}' % MODEL.encode(),
            )
        assert reply.status_code == 400, reply.text
        assert named in reply.json()["error"]["message"]
        assert nan.status_code == 400 and "not valid JSON" in nan.json()["error"]["message"]
        assert backend.inputs == []

    asyncio.run(body())


# -- requests in flight per API key -----------------------------------------------------


def test_each_key_has_its_own_in_flight_limit_released_on_every_path():
    async def body():
        gate = asyncio.Event()
        backend = FakeBackend(tokenizer=FakeTokenizer(), gate=gate)
        limits = RequestLimits(max_in_flight_per_key=1)
        k1, k2 = {"authorization": "Bearer k1"}, {"authorization": "Bearer k2"}
        async with fronts(backend, ("k1", "k2"), limits=limits) as (server, http, stub):
            held = asyncio.create_task(http.post("/v1/completions", json=completion(), headers=k1))
            await backend.wait_for(lambda b: len(b.running) == 1)
            second = await http.post("/v1/completions", json=completion(), headers=k1)
            on_grpc = await grpc_error(stub, pb.GenerateRequest(prompt="x"), key="k1")
            other = asyncio.create_task(http.post("/v1/completions", json=completion(), headers=k2))
            await backend.wait_for(lambda b: len(b.running) == 2)  # k2 is not k1's
            gate.set()
            assert (await held).status_code == 200 and (await other).status_code == 200
            gate.clear()
            async with httpx.AsyncClient(base_url=server.http.url, timeout=0.5) as quitter:
                with pytest.raises(httpx.ReadTimeout):  # gives up and hangs up
                    await quitter.post("/v1/completions", json=completion(), headers=k1)
            await backend.wait_for(lambda b: len(b.aborted) == 1)
            async with asyncio.timeout(WAIT_S):  # the disconnected call has finished
                while server.lifecycle.stats.in_flight:
                    await asyncio.sleep(0.01)
            failing = pb.GenerateRequest(prompt="x", stop=["a"] * 99)  # refused after admission
            refused = await grpc_error(stub, failing, key="k1")
            gate.set()
            again = await http.post("/v1/completions", json=completion(), headers=k1)
        assert second.status_code == 429 and "this API key" in second.json()["error"]["message"]
        assert on_grpc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this API key" in on_grpc.details()
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert again.status_code == 200

    asyncio.run(body())


# -- request ids in logs --------------------------------------------------------------


def test_request_ids_with_control_characters_are_refused_on_both_fronts():
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        async with fronts(backend) as (_, http, stub):
            header = await http.post(
                "/v1/completions", json=completion(), headers={"x-request-id": "a\tb"}
            )
            errors = [
                await grpc_error(stub, pb.GenerateRequest(prompt="x", request_id=rid))
                for rid in ("a\nevent=forged", "a\rb", "a\x1b[2Kb", "a\u202eb", "x" * 257)
            ]
        assert header.status_code == 400 and "x-request-id" in header.json()["error"]["message"]
        assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
        assert all("request_id" in e.details() for e in errors)
        assert backend.inputs == []

    asyncio.run(body())


@pytest.mark.parametrize("value", ["a\nevent=forged", "a\rb", "\x1b[31mred", "a\u2028b", "a\\b"])
def test_log_fields_cannot_break_or_forge_a_line(value):
    line = format_fields({"request_id": value, "status": "OK"})
    assert line.isprintable() and line.isascii()
    assert line.endswith(" status=OK") and line.count("=") - value.count("=") == 2


def test_the_grpc_port_takes_what_a_configured_max_model_len_can_use():
    cap = 64 << 20
    assert transport_message_limit(ServeConfig()) == cap  # the model's limit is not known yet
    limit = transport_message_limit(ServeConfig(engine={"max_model_len": 4096}))
    assert 4096 * TRANSPORT_BYTES_PER_TOKEN < limit < 2 << 20
    huge = ServeConfig(engine={"max_model_len": 10**6}, limits={"max_message_mb": 8})
    assert transport_message_limit(huge) == 8 << 20
