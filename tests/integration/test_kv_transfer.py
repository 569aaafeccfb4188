"""KV transfer between processes over real gRPC on 127.0.0.1.

Every peer is its own process (benchkit/kv_peer.py). Each test checks
that the free block counts of every pool it touched return to their
starting values: no path may strand blocks. The transfer tests run twice:
chunks over the data connection (the default), and over the gRPC stream
(receivers with the data channel off; clients that ask for one fall back).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import grpc
import pytest
import torch

from benchkit.kv_peer import Peer, PeerSpec, push_grant
from engine.block_pool import BlockPool
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import (
    GrpcKVServer,
    PoolBlockStore,
    TransferConfig,
    TransferError,
    datachannel,
    wire,
)
from kv_transfer.grpc_server import PUSH_METHOD
from net import handshake
from net.security import ClusterSecurity
from protos.tandem.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.integration

LAYOUT = KVLayout("fp-test", "float32", 8, 16, 4, 64)  # 256 KiB per block
BIG = 1024  # blocks: 256 MiB
SECURITY = ClusterSecurity.generate()  # shared by the peers of the module
SMALL_CHUNKS = TransferConfig(chunk_bytes=256 << 10, security=SECURITY)
CPU = torch.device("cpu")


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module", params=["data", "grpc"])
def peers(request):
    data = request.param == "data"
    specs = {
        "sender": PeerSpec(
            BIG + 64, LAYOUT, seed=1, config=TransferConfig(data_channel=data, security=SECURITY)
        ),
        "receiver": PeerSpec(
            BIG + 64,
            LAYOUT,
            seed=2,
            config=TransferConfig(lease_s=120, data_channel=data, security=SECURITY),
        ),
        "short_lease": PeerSpec(
            64,
            LAYOUT,
            seed=3,
            config=TransferConfig(lease_s=1.0, data_channel=data, security=SECURITY),
        ),
        "other_layout": PeerSpec(
            64,
            KVLayout("fp-test", "float32", 8, 16, 2, 64),
            seed=4,
            config=TransferConfig(data_channel=data, security=SECURITY),
        ),
    }
    started = {name: Peer(spec) for name, spec in specs.items()}
    try:
        for peer in started.values():
            _ = peer.address
        yield started
    finally:
        for peer in started.values():
            peer.close()


@pytest.fixture(autouse=True)
def pools_return_to_start(request):
    if "peers" not in request.fixturenames:
        yield
        return
    peers = request.getfixturevalue("peers")
    before = {name: p.call("num_free") for name, p in peers.items()}
    yield
    for name, p in peers.items():
        assert wait_until(lambda p=p: p.call("holders") == []), (name, p.call("holders"))
        assert p.call("num_free") == before[name], name


@pytest.mark.timeout(600)
def test_push_256_mib_arrives_intact(peers):
    sender, receiver = peers["sender"], peers["receiver"]
    blocks = sender.call("allocate", BIG)
    try:
        remote, nbytes, _ = sender.call("push", receiver.address, "big", blocks)
        assert nbytes == BIG * LAYOUT.block_bytes >= 256 << 20
        assert len(remote) == BIG
        assert receiver.call("claim", "big") == remote
        assert receiver.call("digest", remote) == sender.call("digest", blocks)
        receiver.call("release", remote)
    finally:
        sender.call("release", blocks)


def test_pull_by_hash_gets_the_held_prefix(peers):
    sender, receiver = peers["sender"], peers["receiver"]
    hashes, _, digest = sender.call("make_cached", 5, 7)
    missing = [bytes(16)]
    block_ids, nbytes = receiver.call("pull", sender.address, hashes + missing)
    assert len(block_ids) == 5 and nbytes == 5 * LAYOUT.block_bytes
    assert receiver.call("digest", block_ids) == digest
    # A second pull finds nothing past the first unknown hash.
    assert receiver.call("pull", sender.address, missing + hashes) == ([], 0)
    receiver.call("release", block_ids)


def test_layout_mismatch_is_refused_naming_the_field(peers):
    sender, other = peers["sender"], peers["other_layout"]
    blocks = sender.call("allocate", 4)
    try:
        with pytest.raises(TransferError) as err:
            sender.call("push", other.address, "mismatch", blocks)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "num_kv_heads" in err.value.message
        with pytest.raises(TransferError) as err:
            other.call("pull", sender.address, [bytes(16)])
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "num_kv_heads" in err.value.message
    finally:
        sender.call("release", blocks)


def test_corrupted_chunk_fails_and_frees_reserved_blocks(peers):
    sender, receiver = peers["sender"], peers["receiver"]
    blocks = sender.call("allocate", 64)
    try:
        with pytest.raises(TransferError) as err:
            sender.call("push", receiver.address, "corrupt", blocks, None, None, None, 3)
        assert err.value.code == grpc.StatusCode.DATA_LOSS
        assert receiver.call("claim", "corrupt") is None
    finally:
        sender.call("release", blocks)


def test_sender_killed_mid_stream_frees_reserved_blocks(peers):
    receiver = peers["receiver"]
    start = receiver.call("num_free")
    doomed = Peer(PeerSpec(64, LAYOUT, seed=5, config=SMALL_CHUNKS))
    try:
        blocks = doomed.call("allocate", 32)
        doomed.submit("push", receiver.address, "killed", blocks, None, None, 4)
        assert wait_until(lambda: receiver.call("num_free") == start - 32)
        doomed.kill()
        assert wait_until(lambda: receiver.call("holders") == [])
        assert receiver.call("num_free") == start
        assert receiver.call("claim", "killed") is None
    finally:
        doomed.close()


def test_lease_expiry_frees_stalled_and_unclaimed_transfers(peers):
    short = peers["short_lease"]
    start = short.call("num_free")
    stalled = Peer(PeerSpec(64, LAYOUT, seed=6, config=SMALL_CHUNKS))
    try:
        blocks = stalled.call("allocate", 32)
        stalled.submit("push", short.address, "stalled", blocks, None, None, 4)
        assert wait_until(lambda: short.call("num_free") == start - 32)
        # The sender is alive but silent: only the lease can free the blocks.
        assert wait_until(lambda: short.call("holders") == [])
        assert short.call("num_free") == start
        assert stalled.process.is_alive()
    finally:
        stalled.close()

    sender = peers["sender"]
    blocks = sender.call("allocate", 8)
    try:
        sender.call("push", short.address, "unclaimed", blocks)
        assert wait_until(lambda: short.call("holders") == [])  # never claimed
        assert short.call("num_free") == start
        assert short.call("claim", "unclaimed") is None
    finally:
        sender.call("release", blocks)


def test_data_connection_is_offered_and_an_abandoned_one_frees_the_blocks():
    """In one process: the server offers a data port once the header passed;
    a stray connection with a wrong token is dropped; a push whose data
    connection never comes is freed by its lease."""

    async def go():
        store = PoolBlockStore(BlockPool(16, LAYOUT.block_size), KVCache(LAYOUT, 16, CPU))
        config = TransferConfig(lease_s=0.5, reap_interval_s=0.05)
        server = GrpcKVServer(store, config)
        await server.start()
        channel = config.security.channel(server.address)
        try:
            token = bytes(range(16))
            call = channel.stream_unary(
                PUSH_METHOD,
                request_serializer=lambda b: b,
                response_deserializer=pb.PushReply.FromString,
            )(metadata=((datachannel.DATA_TOKEN_KEY, token.hex()),), timeout=30)
            header = pb.TransferHeader(
                layout=wire.layout_to_proto(LAYOUT),
                request_id="abandoned",
                num_blocks=4,
                token_ids=list(range(4 * LAYOUT.block_size)),
                total_bytes=4 * LAYOUT.block_bytes,
                grant=push_grant(config, server.address, "abandoned"),
            )
            await call.write(wire.encode_header(header))
            metadata = dict(await call.initial_metadata())
            port = int(metadata[datachannel.DATA_PORT_KEY])
            assert store.num_free == 12 and [h.kind for h in store.holders()] == ["lease"]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as stray:
                # The right secret and tag, but a token no push expects.
                audience = handshake.tcp_audience("127.0.0.1", port)
                tag = datachannel.HANDSHAKE_TAG
                handshake.connect(stray, config.security, tag, bytes(16), audience)
                assert stray.recv(1) == b""  # dropped
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call  # the lease expires: blocks freed, call ended
            assert err.value.code() == grpc.StatusCode.ABORTED
            assert store.holders() == [] and store.num_free == 16
            assert server.claim("abandoned") is None
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(go())


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_decode_after_push_continues_like_one_engine(llama_dir):
    params = {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
    spec = PeerSpec(64, model=str(llama_dir), config=TransferConfig(security=SECURITY))
    prefill, decode = Peer(spec), Peer(spec)
    try:
        free = (prefill.call("num_free"), decode.call("num_free"))
        for i, n in enumerate([7, 33, 70]):
            prompt = _prompt(n, i)
            alone = prefill.call("generate", f"alone{i}", prompt, params)
            first, _, _ = prefill.call("prefill_and_push", decode.address, f"r{i}", prompt, params)
            assert len(first) == 1
            split = decode.call("decode_pushed", f"r{i}", prompt, first, params)
            assert split == alone
        assert prefill.call("holders") == decode.call("holders") == []
        assert (prefill.call("num_free"), decode.call("num_free")) == free
    finally:
        prefill.close()
        decode.close()
