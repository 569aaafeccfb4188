"""Property-based fuzzing of the KV endpoints: PushBlocks over gRPC and the raw
TCP data channel, against one in-process server (secret on) on 127.0.0.1.

A valid push is built, then broken: messages truncated, dropped, duplicated,
reordered or replaced by garbage; chunks mislabelled (span, hashes, checksum)
or oversized; headers with absurd sizes. Every call must end with a precise
status, never UNKNOWN/INTERNAL or a hang; the server's pool must be left
with no block holder and return to its starting free block count; and a
valid push must still work afterwards.

Examples: ``TANDEM_FUZZ_EXAMPLES`` (default 60 per test).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import zlib

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kv_transfer import TransferConfig, datachannel, wire
from kv_transfer.grpc_server import PUSH_METHOD
from net import handshake
from net.security import ClusterSecurity
from protos.tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_harness import LAYOUT, KVServerHarness, block_hashes, block_tokens, header

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "60"))
# Up to 10 s an example (lease expiries included), 600 s at least.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(max(600, 10 * EXAMPLES))]
SECRET = b"fuzz-secret"
CONFIG = TransferConfig(
    security=ClusterSecurity(SECRET),
    chunk_bytes=512,
    max_message_bytes=(1 << 20) + 4096,
    lease_s=5,
)
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.PERMISSION_DENIED,  # no grant, or one for another request
    grpc.StatusCode.ALREADY_EXISTS,  # a grant used already
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def harness():
    h = KVServerHarness(CONFIG, num_blocks=32)
    yield h
    h.close()


@pytest.fixture(scope="module")
def grpc_only():
    h = KVServerHarness(
        TransferConfig(
            security=CONFIG.security,
            chunk_bytes=CONFIG.chunk_bytes,
            max_message_bytes=CONFIG.max_message_bytes,
            lease_s=CONFIG.lease_s,
            data_channel=False,
        ),
        num_blocks=32,
    )
    yield h
    h.close()


_counter = iter(range(10**9))


def _valid_push(
    h: KVServerHarness, n: int, seed: int, with_hashes: bool
) -> tuple[str, list[bytes]]:
    """(request id, [header, chunks..., commit]) of a valid, granted push of n blocks."""
    rid = f"fuzz-{next(_counter)}"
    rng = random.Random(seed)
    tokens = block_tokens(n, zlib.crc32(rid.encode()))  # no prefix of an earlier push
    # Blocks named without a hash carry b"" on the wire.
    hashes = block_hashes(tokens) if with_hashes else [b""] * n
    head = header(rid, n, block_hashes=hashes, token_ids=tokens, grant=h.push_grant(rid))
    messages = [wire.encode_header(head)]
    bl = LAYOUT.block_bytes_per_layer
    spans = wire.plan_chunks(LAYOUT.num_layers, n, bl, CONFIG.chunk_bytes)
    for span in spans:
        ls, le, bs, be = span
        payload = rng.randbytes((le - ls) * (be - bs) * bl)
        messages.append(wire.encode_chunk(span, hashes[bs:be], len(payload), _filler(payload)))
    messages.append(wire.encode_commit())
    return rid, messages


def _filler(payload: bytes):
    def fill(out: memoryview) -> None:
        out[:] = payload

    return fill


MUTATIONS = (
    "truncate",
    "drop",
    "duplicate",
    "swap",
    "garbage",
    "oversized",
    "relabel_span",
    "relabel_hashes",
    "flip_payload_byte",
    "wrong_size",
    "huge_header",
    "bad_header",
)


def _mutate(messages: list[bytes], kind: str, rng: random.Random) -> list[bytes]:
    out = list(messages)
    chunks = [i for i, m in enumerate(out) if isinstance(wire.decode(m), wire.Chunk)]
    chunk_at = rng.choice(chunks) if chunks else None
    if not out:
        return out
    if kind == "truncate":
        i = rng.randrange(len(out))
        out[i] = out[i][: rng.randrange(len(out[i]) or 1)]
    elif kind == "drop":
        del out[rng.randrange(len(out))]
    elif kind == "duplicate":
        i = rng.randrange(len(out))
        out.insert(i, out[i])
    elif kind == "swap":
        i, j = rng.randrange(len(out)), rng.randrange(len(out))
        out[i], out[j] = out[j], out[i]
    elif kind == "garbage":
        out.insert(rng.randrange(len(out) + 1), rng.randbytes(rng.randrange(1, 300)))
    elif kind == "oversized":  # over the server's message limit
        out.insert(rng.randrange(len(out) + 1), bytes(CONFIG.max_message_bytes + 10))
    elif chunk_at is None:
        pass  # the chunk mutations below need a chunk
    elif kind in ("relabel_span", "relabel_hashes", "wrong_size"):
        chunk = wire.decode(out[chunk_at])
        ls, le, bs, be = chunk.layer_start, chunk.layer_end, chunk.block_start, chunk.block_end
        size = len(chunk.data)
        hashes = [bytes(32)] * max(be - bs, 0)
        if kind == "relabel_span":
            ls, le = rng.choice([(ls, le + 1), (le, le + 1), (ls + 5, le + 5), (1, 0)])
            bs, be = rng.choice([(bs, be), (bs + 1, be + 1), (be, bs), (0, 1000)])
        elif kind == "wrong_size":
            size += rng.choice([-1, 1, LAYOUT.block_bytes_per_layer, -size])
        out[chunk_at] = wire.encode_chunk(
            (ls, le, bs, be),
            hashes if kind == "relabel_hashes" else [],
            max(size, 0),
            lambda view: None,
        )
    elif kind == "flip_payload_byte":
        broken = bytearray(out[chunk_at])
        broken[-1 - rng.randrange(min(64, len(broken) - 1))] ^= 0xFF
        out[chunk_at] = bytes(broken)
    elif kind == "huge_header":
        n = rng.choice([33, 10**6, 2**32 - 1])
        out[0] = wire.encode_header(header(f"huge-{next(_counter)}", n, total_bytes=0))
    elif kind == "bad_header":
        rid = f"bad-{next(_counter)}"
        bad = rng.choice(
            [
                {"total_bytes": 7},
                {"block_hashes": [b"x"] * 3},
                {"token_ids": list(range(10_000))},
                {"request_id": ""},
                {"layout": pb.KVLayout(model_fingerprint="other", dtype="float32")},
            ]
        )
        fields = {"request_id": rid, **bad}
        out[0] = wire.encode_header(header(fields.pop("request_id"), 2, **fields))
    return out


def _assert_still_serves(h: KVServerHarness) -> None:
    assert h.settle() == ([], h.initial_free)
    _, messages = _valid_push(h, 3, seed=0, with_hashes=False)
    assert h.raw_push(messages) == grpc.StatusCode.OK
    assert h.settle() == ([], h.initial_free)


@FUZZ_SETTINGS
@given(
    n=st.integers(1, 12),
    seed=st.integers(0, 2**32),
    with_hashes=st.booleans(),
    kinds=st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3),
)
def test_fuzzed_grpc_pushes_get_a_precise_status_and_leak_nothing(
    grpc_only, n, seed, with_hashes, kinds
):
    rng = random.Random(seed)
    _, messages = _valid_push(grpc_only, n, seed, with_hashes)
    for kind in kinds:
        messages = _mutate(messages, kind, rng)
    status = grpc_only.raw_push(messages)
    event(status.name)
    assert status in PRECISE, (status, kinds)
    _assert_still_serves(grpc_only)


FRAME_MUTATIONS = ("truncate", "garbage", "bad_magic", "oversized", "relabel", "flip", "no_end")


@FUZZ_SETTINGS
@given(
    n=st.integers(1, 12),
    seed=st.integers(0, 2**32),
    kinds=st.lists(st.sampled_from(FRAME_MUTATIONS), min_size=1, max_size=3),
)
def test_fuzzed_data_channel_frames_get_a_precise_status_and_leak_nothing(harness, n, seed, kinds):
    rng = random.Random(seed)
    frames = _valid_frames(n, rng)
    for kind in kinds:
        frames = _mutate_frames(frames, kind, rng)
    status = harness.thread.run(_push_frames(harness, n, frames))
    event(status.name)
    assert status in PRECISE, (status, kinds)
    _assert_still_serves(harness)


def _valid_frames(n: int, rng: random.Random) -> list[bytes]:
    bl = LAYOUT.block_bytes_per_layer
    frames = []
    for span in wire.plan_chunks(LAYOUT.num_layers, n, bl, CONFIG.chunk_bytes):
        ls, le, bs, be = span
        payload = rng.randbytes((le - ls) * (be - bs) * bl)
        frames.append(
            datachannel.encode_frame(span, len(payload), datachannel.checksum([payload])) + payload
        )
    return [*frames, datachannel.END_FRAME]


def _mutate_frames(frames: list[bytes], kind: str, rng: random.Random) -> list[bytes]:
    out = list(frames)
    if not out:
        return out
    i = rng.randrange(len(out))
    size = datachannel.FRAME.size
    if kind == "truncate":
        out[i] = out[i][: rng.randrange(len(out[i]) or 1)]
        del out[i + 1 :]  # the connection ends there
    elif kind == "garbage":
        out.insert(i, rng.randbytes(rng.randrange(1, 200)))
    elif kind == "bad_magic":
        out[i] = b"XXXX" + out[i][4:]
    elif kind == "oversized":
        out.insert(i, datachannel.FRAME.pack(datachannel.CHUNK_MAGIC, 0, 1, 0, 1, 2**40, 0))
    elif kind == "relabel" and len(out[i]) >= size and out[i][:4] == datachannel.CHUNK_MAGIC:
        _, ls, le, bs, be, nbytes, digest = datachannel.FRAME.unpack(out[i][:size])
        payload = out[i][size:]
        ls, le, bs, be = rng.choice([(le, le + 1, bs, be), (ls, le, be, be + 1), (1, 0, 0, 1)])
        out[i] = datachannel.FRAME.pack(datachannel.CHUNK_MAGIC, ls, le, bs, be, nbytes, digest)
        out[i] += payload
    elif kind == "flip" and len(out[i]) > size:
        broken = bytearray(out[i])
        broken[rng.randrange(size, len(broken))] ^= 0x01
        out[i] = bytes(broken)
    elif kind == "no_end":
        out = [f for f in out if f != datachannel.END_FRAME]
    return out


async def _push_frames(h: KVServerHarness, n: int, frames: list[bytes]) -> grpc.StatusCode:
    """A push whose header goes over gRPC and whose chunks are ``frames`` on
    the data connection; the call's status."""
    token = os.urandom(datachannel.TOKEN_BYTES)
    call = h.channel.stream_unary(
        PUSH_METHOD,
        request_serializer=lambda b: b,
        response_deserializer=pb.PushReply.FromString,
    )(
        metadata=((datachannel.DATA_TOKEN_KEY, token.hex()),),
        timeout=30,
    )
    rid = f"frames-{next(_counter)}"
    try:
        tokens = block_tokens(n, zlib.crc32(rid.encode()))
        head = header(rid, n, token_ids=tokens, grant=h.push_grant(rid))
        await call.write(wire.encode_header(head))
        port = int(dict(await call.initial_metadata())[datachannel.DATA_PORT_KEY])

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                audience = handshake.tcp_audience("127.0.0.1", port)
                handshake.connect(conn, CONFIG.security, datachannel.HANDSHAKE_TAG, token, audience)
                for frame in frames:
                    conn.sendall(frame)

        # The server may hang up on a bad frame: the call's status says why.
        with contextlib.suppress(OSError):
            await asyncio.to_thread(send)
        await call.write(wire.encode_commit())
        await call.done_writing()
        reply = await call
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return await call.code()
    held = h.server.claim(reply.request_id)
    if held is not None:
        h.store.release(held.holder, held.block_ids)
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def cached_hashes(grpc_only) -> list[bytes]:
    """Hashes of 8 blocks the server holds in its prefix cache (pushed, then
    claimed and released)."""
    _, messages = _valid_push(grpc_only, 8, seed=12345, with_hashes=True)
    assert grpc_only.raw_push(messages) == grpc.StatusCode.OK
    return list(pb.PushRequest.FromString(messages[0]).header.block_hashes)


@st.composite
def pull_requests(draw, h: KVServerHarness, cached: list[bytes]) -> bytes:
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=200))  # garbage
    layout = wire.layout_to_proto(LAYOUT)
    if draw(st.integers(0, 4)) == 0:
        layout.num_layers = draw(st.integers(0, 2**32 - 1))
    hashes = draw(
        st.lists(
            st.one_of(st.sampled_from(cached), st.binary(max_size=40)),
            max_size=draw(st.sampled_from([10, 3000])),
        )
    )
    if draw(st.booleans()):
        hashes = cached[: draw(st.integers(0, len(cached)))] + hashes
    rid = f"{draw(st.text(max_size=20))}#{next(_counter)}"
    granted = draw(st.integers(0, 4)) > 0  # most with the router's grant for them
    grant = h.pull_grant(rid, hashes) if granted else draw(st.binary(max_size=60))
    request = pb.PullRequest(
        layout=layout, request_id=rid, block_hashes=hashes, grant=grant
    ).SerializeToString()
    if draw(st.integers(0, 4)) == 0:
        request = request[: draw(st.integers(0, len(request)))]  # truncated
    return request


@FUZZ_SETTINGS
@given(data=st.data())
def test_fuzzed_pulls_get_a_precise_status_and_leak_nothing(grpc_only, cached_hashes, data):
    request = data.draw(pull_requests(grpc_only, cached_hashes))

    async def pull() -> tuple[grpc.StatusCode, list]:
        from kv_transfer.grpc_server import PULL_METHOD

        call = grpc_only.channel.unary_stream(
            PULL_METHOD, request_serializer=lambda b: b, response_deserializer=wire.decode
        )(request, timeout=20)
        messages = []
        try:
            async for msg in call:
                messages.append(msg)
        except grpc.aio.AioRpcError as e:
            return e.code(), messages
        return grpc.StatusCode.OK, messages

    status, messages = grpc_only.thread.run(pull())
    event(status.name)
    assert status in PRECISE, status
    assert not any(isinstance(m, wire.Malformed) for m in messages)
    if status == grpc.StatusCode.OK:
        assert isinstance(messages[0], pb.TransferHeader)
    assert grpc_only.settle() == ([], grpc_only.initial_free)
