"""Cluster secret, TLS and message limits of the KV endpoints (gRPC and the
raw data channel), each server in this process on 127.0.0.1.

Every test checks that the receiving pool is left with no block holder and
its free block count back at its start: a refused peer never holds a block.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl

import grpc
import pytest
import torch

from engine.block_pool import Holder
from kv_transfer import GrpcKVClient, TransferConfig, TransferError, datachannel, wire
from net import handshake
from net.security import ClusterSecurity
from protos.tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_harness import LAYOUT, KVServerHarness, block_tokens, header, make_store
from tests.tls_certs import tls_files

pytestmark = pytest.mark.integration

SECRET = b"correct horse battery staple"
SENDER = Holder("request", "sender")  # the sending pool's blocks


def _push(harness: KVServerHarness, config: TransferConfig, n: int = 3, rid: str = "r"):
    """Push ``n`` blocks from a fresh sender pool with a client of ``config``;
    checks the data arrived, releases it, returns the push result."""
    src = make_store(32, seed=7)
    ids = src.reserve(SENDER, n)[::-1]  # one payload view per block: many small TLS records
    client = GrpcKVClient(config)
    try:
        result = harness.thread.run(
            client.push(harness.server.address, src, harness.blocks(rid, ids))
        )
        claimed = harness.server.claim(rid)
        assert claimed.block_ids == result.remote_block_ids
        got = harness.store.cache.read_blocks(claimed.block_ids)
        assert torch.equal(got, src.cache.read_blocks(ids))
        harness.store.release(claimed.holder)
    finally:
        harness.thread.run(client.close())
        src.release(SENDER)
    assert src.holders() == [] and src.num_free == 32
    return result


def _dropped(conn: socket.socket) -> bool:
    """Whether the server closed (or reset) the connection without a byte."""
    try:
        return conn.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def _status_of_push(harness: KVServerHarness, config: TransferConfig) -> grpc.StatusCode:
    src = make_store(16, seed=7)
    ids = src.reserve(SENDER, 2)
    client = GrpcKVClient(config)
    try:
        harness.thread.run(client.push(harness.server.address, src, harness.blocks("x", ids)))
    except TransferError as e:
        return e.code
    finally:
        harness.thread.run(client.close())
        src.release(SENDER)
    return grpc.StatusCode.OK


@pytest.mark.parametrize("data_channel", [True, False])
def test_a_push_without_the_cluster_secret_is_refused(data_channel):
    secured = TransferConfig(security=ClusterSecurity(SECRET), data_channel=data_channel)
    harness = KVServerHarness(secured)
    try:
        for wrong in (ClusterSecurity.generate(), ClusterSecurity(b"correct horse battery")):
            config = dataclasses.replace(secured, security=wrong)
            assert _status_of_push(harness, config) == grpc.StatusCode.UNAUTHENTICATED
            client = GrpcKVClient(config)
            with pytest.raises(TransferError) as err:
                harness.thread.run(client.pull(harness.server.address, make_store(), [bytes(32)]))
            harness.thread.run(client.close())
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert harness.settle() == ([], harness.initial_free)
        result = _push(harness, secured)  # the peer that knows it gets through
        assert result.bytes_sent == 3 * LAYOUT.block_bytes
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


def test_the_secret_never_shows_in_a_repr():
    config = TransferConfig(security=ClusterSecurity(SECRET))
    assert SECRET.decode() not in repr(config)
    assert SECRET.hex() not in repr(config)


def test_a_data_connection_without_the_secrets_mac_is_dropped():
    """The token travels in the (authenticated) call; a connection that knows
    the token but not the secret still gets nothing."""
    harness = KVServerHarness(TransferConfig(security=ClusterSecurity(SECRET), lease_s=60))
    try:

        async def go() -> None:
            token = bytes(range(16))
            from kv_transfer.grpc_server import PUSH_METHOD
            from protos.tandem.v1 import kv_transfer_pb2 as pb

            call = harness.channel.stream_unary(
                PUSH_METHOD,
                request_serializer=lambda b: b,
                response_deserializer=pb.PushReply.FromString,
            )(
                metadata=((datachannel.DATA_TOKEN_KEY, token.hex()),),
                timeout=30,
            )
            grant = harness.push_grant("stolen")
            head = header("stolen", 2, token_ids=block_tokens(2), grant=grant)
            await call.write(wire.encode_header(head))
            port = int(dict(await call.initial_metadata())[datachannel.DATA_PORT_KEY])
            assert harness.store.num_free == harness.initial_free - 2
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                guess = ClusterSecurity(b"guess")
                audience = handshake.tcp_audience("127.0.0.1", port)
                handshake.connect(conn, guess, datachannel.HANDSHAKE_TAG, token, audience)
                assert _dropped(conn)  # before any frame
            call.cancel()

        harness.thread.run(go())
        assert harness.settle() == ([], harness.initial_free)
        _push(harness, TransferConfig(security=ClusterSecurity(SECRET)))  # still serves
    finally:
        harness.close()


@pytest.mark.parametrize("data_channel", [True, False])
def test_tls_kv_endpoints_refuse_plaintext_and_strangers(cluster_certs, data_channel):
    """TLS pushes over the gRPC stream (the default under TLS) and over the
    data channel (``tls_data_channel``)."""
    tls = TransferConfig(
        security=ClusterSecurity(SECRET, tls_files(cluster_certs[0])), tls_data_channel=data_channel
    )
    harness = KVServerHarness(tls)
    try:
        assert (harness.server._data is not None) == data_channel
        plaintext = dataclasses.replace(tls, security=ClusterSecurity(SECRET))
        assert _status_of_push(harness, plaintext) == grpc.StatusCode.UNAVAILABLE
        stranger = dataclasses.replace(
            tls, security=ClusterSecurity(SECRET, tls_files(cluster_certs[1]))
        )
        assert _status_of_push(harness, stranger) == grpc.StatusCode.UNAVAILABLE
        assert harness.settle() == ([], harness.initial_free)
        for n in (1, 5, 17):  # 5 once lost its tail to a RST (an unread TLS session ticket)
            result = _push(harness, tls, n, rid=f"r{n}")
            assert result.bytes_sent == n * LAYOUT.block_bytes
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


def test_tls_data_channel_refuses_a_plaintext_connection(cluster_certs):
    harness = KVServerHarness(
        TransferConfig(
            security=ClusterSecurity(SECRET, tls_files(cluster_certs[0])), tls_data_channel=True
        )
    )
    try:
        data = harness.server._data
        assert data is not None
        with socket.create_connection(("127.0.0.1", data.port), timeout=10) as conn:
            conn.sendall(handshake.MAGIC + bytes(64))
            assert _dropped(conn)  # not a TLS hello
        # A TLS client whose certificate another CA signed: no further.
        ctx = ClusterSecurity.generate(tls_files(cluster_certs[1])).client_ssl_context()
        assert ctx is not None
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", data.port), timeout=10) as raw:
            try:
                conn = ctx.wrap_socket(raw)
            except (ssl.SSLError, ConnectionError):
                pass  # refused in the handshake
            else:
                with conn:
                    with contextlib.suppress(ssl.SSLError, ConnectionError):
                        conn.sendall(handshake.MAGIC + bytes(64))
                    assert _dropped(conn)
        _push(
            harness, TransferConfig(security=ClusterSecurity(SECRET, tls_files(cluster_certs[0])))
        )
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


def test_kv_messages_over_the_limit_are_refused():
    limit = TransferConfig(chunk_bytes=1024, max_message_bytes=(1 << 20) + 1024)
    harness = KVServerHarness(limit)
    try:
        huge = wire.encode_header(header("big", 2, token_ids=list(range(400_000))))
        assert len(huge) > limit.max_message_bytes
        status = harness.raw_push([huge])
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert harness.settle() == ([], harness.initial_free)
        _push(harness, limit)
    finally:
        harness.close()


def test_transfer_config_refuses_a_limit_below_the_chunk_size():
    with pytest.raises(ValueError, match="max_message_bytes"):
        TransferConfig(chunk_bytes=8 << 20, max_message_bytes=8 << 20)


def test_a_client_runs_at_most_max_concurrent_pushes_at_once():
    """A burst of pushes queues in the client (found by bench/load.py: 1,000
    pushes at once crawled past their deadlines): a push's call opens (its
    header goes out) only once fewer than ``max_concurrent_pushes`` run."""
    config = TransferConfig()
    harness = KVServerHarness(config, num_blocks=64)
    src = make_store(64)
    running = {"now": 0, "peak": 0}

    def opened(msg: bytes) -> bytes:  # the client's filter sees every message it sends
        if isinstance(wire.decode(msg), pb.TransferHeader):
            running["now"] += 1
            running["peak"] = max(running["peak"], running["now"])
        return msg

    client = GrpcKVClient(dataclasses.replace(config, max_concurrent_pushes=2), opened)

    async def push(i: int, block_ids: list[int]):
        result = await client.push(harness.server.address, src, harness.blocks(f"b{i}", block_ids))
        running["now"] -= 1
        return result

    async def burst() -> list:
        ids = [src.reserve(Holder("request", f"b{i}"), 2) for i in range(8)]
        results = await asyncio.gather(*(push(i, b) for i, b in enumerate(ids)))
        for i in range(len(ids)):
            harness.store.release(harness.server.claim(f"b{i}").holder)
            src.release(Holder("request", f"b{i}"))
        return results

    try:
        results = harness.thread.run(burst())
        assert len(results) == 8
        assert running == {"now": 0, "peak": 2}
        assert src.holders() == [] and src.num_free == 64  # every push's pins released
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.thread.run(client.close())
        harness.close()


def test_a_kv_server_with_default_options_refuses_a_stranger_with_default_options():
    """No option set anywhere: each TransferConfig holds its own random secret,
    so a client that was not handed the server's cannot push or pull."""
    harness = KVServerHarness(TransferConfig())
    try:
        assert _status_of_push(harness, TransferConfig()) == grpc.StatusCode.UNAUTHENTICATED
        client = GrpcKVClient(TransferConfig())
        with pytest.raises(TransferError) as err:
            harness.thread.run(client.pull(harness.server.address, make_store(), [bytes(32)]))
        harness.thread.run(client.close())
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert harness.settle() == ([], harness.initial_free)
        _push(harness, harness.config)  # the config's own holder gets through
    finally:
        harness.close()


def test_a_peer_with_the_secret_but_no_grant_gets_no_block():
    """The secret lets a peer call; only the router's grant for the request
    lets it push or pull, over gRPC and the data channel alike."""
    secured = TransferConfig(security=ClusterSecurity(SECRET))
    harness = KVServerHarness(secured)
    client = GrpcKVClient(secured)
    src = make_store(16, seed=7)
    ids = src.reserve(SENDER, 2)
    try:
        codes = []
        for grant in (b"", harness.push_grant("another"), bytes(41)):
            blocks = dataclasses.replace(harness.blocks("g", ids), grant=grant)
            with pytest.raises(TransferError) as err:
                harness.thread.run(client.push(harness.server.address, src, blocks))
            codes.append(err.value.code)
        header_only = wire.encode_header(header("g", 8, token_ids=block_tokens(8)))
        codes.append(harness.raw_push([header_only]))
        with pytest.raises(TransferError) as pulled:
            harness.thread.run(client.pull(harness.server.address, make_store(), [bytes(16)]))
        codes.append(pulled.value.code)
        assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 5
        assert harness.settle() == ([], harness.initial_free)
        assert harness.store.pool.cached_hashes() == []
    finally:
        harness.thread.run(client.close())
        src.release(SENDER)
        harness.close()
