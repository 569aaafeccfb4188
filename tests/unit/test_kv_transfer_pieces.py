"""KV transfer pieces without a network: framing, chunk plan, leases, and
the sender/receiver/service logic through the in-process mover."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import socket
import threading
import zlib

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engine.block_pool import BlockPool, Holder
from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import (
    CommittedPush,
    GrpcKVClient,
    GrpcKVServer,
    KVBlocks,
    PoolBlockStore,
    TransferConfig,
    TransferError,
    datachannel,
    wire,
)
from kv_transfer.feed import KVFeed
from kv_transfer.interface import PushHeader
from kv_transfer.lease import LeaseTable, lease_holder
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from net import handshake, sockets
from net.security import ClusterSecurity
from protos import codegen
from protos.tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_grants import granted, pull_grant
from tests.kv_inproc import InProcHub, InProcKVClient, InProcKVServer
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

LAYOUT = KVLayout("fp", "float32", 3, 4, 2, 8)  # 512 bytes per block and layer
SENDER = Holder("request", "r")  # the sending side's blocks, as a prefilled request holds them


def make_store(num_blocks: int = 32, seed: int = 0, layout: KVLayout = LAYOUT) -> PoolBlockStore:
    cache = KVCache(layout, num_blocks, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for t in cache.layers:
        t.copy_(torch.randn(t.shape, generator=gen))
    return PoolBlockStore(BlockPool(num_blocks, layout.block_size), cache)


def test_chunk_encoding_is_plain_protobuf_and_decodes_without_copy():
    payload = bytes(range(200))
    msg = wire.encode_chunk(
        (0, 2, 1, 3), [b"a" * 16, b"b" * 16], 200, lambda v: v.__setitem__(slice(None), payload)
    )
    parsed = pb.PushRequest.FromString(msg).chunk
    assert (parsed.layer_end, parsed.block_start, parsed.data) == (2, 1, payload)
    assert parsed.crc32 == zlib.crc32(payload)
    chunk = wire.decode(msg)
    assert isinstance(chunk, wire.Chunk)
    assert bytes(chunk.data) == payload and chunk.crc32 == parsed.crc32
    assert chunk.block_hashes == (b"a" * 16, b"b" * 16)
    assert wire.decode(wire.encode_commit()) == wire.Commit()
    assert wire.decode(wire.encode_commit([7], b"first")) == wire.Commit((7,), b"first")
    assert isinstance(wire.decode(b"\x12\x05ab"), wire.Malformed)  # truncated


@given(
    layers=st.integers(1, 6),
    blocks=st.integers(1, 40),
    block_bytes=st.integers(1, 64),
    target=st.integers(1, 4000),
)
def test_chunk_plan_covers_every_layer_and_block_once(layers, blocks, block_bytes, target):
    seen = np.zeros((layers, blocks), dtype=int)
    for ls, le, bs, be in wire.plan_chunks(layers, blocks, block_bytes, target):
        seen[ls:le, bs:be] += 1
        assert (le - ls) * (be - bs) * block_bytes <= max(target, block_bytes)
    assert (seen == 1).all()


def test_leases_expire_unless_renewed_or_cancelled():
    now = [0.0]
    table = LeaseTable(clock=lambda: now[0])
    fired: list[str] = []
    a = table.grant(1.0, lambda: fired.append("a"))
    table.grant(1.0, lambda: fired.append("b")).cancel()
    now[0] = 0.9
    a.renew()
    now[0] = 1.5
    assert table.expire_due() == 0
    now[0] = 2.0
    assert table.expire_due() == 1 and fired == ["a"] and not a.active
    assert table.expire_due() == 0 and len(table) == 0


class Pair:
    """A sender store, a receiving in-process server and a client."""

    def __init__(self, config: TransferConfig, message_filter=None, layout=LAYOUT) -> None:
        self.src = make_store(seed=1)
        self.dst = make_store(seed=2, layout=layout)
        self.hub = InProcHub()
        self.config = config
        self.server = InProcKVServer(self.hub, "dst", self.dst, config)
        self.client = InProcKVClient(self.hub, config, message_filter)
        self.free = (self.src.num_free, self.dst.num_free)

    def blocks(self, n: int, request_id: str = "r") -> KVBlocks:
        ids = self.src.reserve(SENDER, n)
        assert ids is not None
        tokens = list(range(100, 100 + n * LAYOUT.block_size))
        blocks = KVBlocks(request_id, ids, [None] * n, tokens)
        return granted(self.config, self.server.address, blocks)

    def settled(self) -> bool:
        return _settled(self.src, self.dst, self.free)


def _settled(src: PoolBlockStore, dst: PoolBlockStore, free: tuple[int, int]) -> bool:
    """No holder left in either pool, and both back to their free counts."""
    no_holders = leftover_holders(src.pool) == leftover_holders(dst.pool) == []
    return no_holders and (src.num_free, dst.num_free) == free


def run(coro):
    return asyncio.run(coro)


SMALL = TransferConfig(chunk_bytes=1024)
PAIR_SECURITY = ClusterSecurity(b"the pair's secret")


def test_push_claim_copies_blocks_exactly():
    async def go():
        pair = Pair(SMALL)
        await pair.server.start()
        blocks = pair.blocks(5)
        result = await pair.client.push(pair.server.address, pair.src, blocks)
        assert pair.src.holders() == [SENDER]  # the push's pins are gone
        claimed = pair.server.claim("r")
        assert claimed.block_ids == result.remote_block_ids and pair.server.claim("r") is None
        assert claimed.holder.kind == "lease" and claimed.holder.id.startswith("recv:r#")
        assert pair.dst.holders() == [claimed.holder]  # until the claimer hands them on
        assert torch.equal(
            pair.dst.cache.read_blocks(claimed.block_ids),
            pair.src.cache.read_blocks(blocks.block_ids),
        )
        assert result.bytes_sent == 5 * LAYOUT.block_bytes
        pair.dst.release(claimed.holder)
        pair.src.release(SENDER)
        await pair.server.stop()
        assert pair.settled()

    run(go())


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        (KVLayout("other", "float32", 3, 4, 2, 8), "model_fingerprint"),
        (KVLayout("fp", "float16", 3, 4, 2, 8), "dtype"),
        (KVLayout("fp", "float32", 3, 4, 2, 16), "head_dim"),
    ],
)
def test_layout_mismatch_names_the_field(layout, field):
    async def go():
        pair = Pair(SMALL, layout=layout)
        await pair.server.start()
        blocks = pair.blocks(2)
        with pytest.raises(TransferError) as err:
            await pair.client.push(pair.server.address, pair.src, blocks)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert field in err.value.message
        pair.src.release(SENDER)
        assert pair.settled()

    run(go())


def _flip_message(n: int):
    count = 0

    def tamper(msg: bytes) -> bytes | None:
        nonlocal count
        count += 1
        if count != n:
            return msg
        broken = bytearray(msg)
        broken[-1] ^= 1
        return bytes(broken)

    return tamper


def _drop_message(n: int):
    count = 0

    def drop(msg: bytes) -> bytes | None:
        nonlocal count
        count += 1
        return None if count == n else msg

    return drop


@pytest.mark.parametrize(
    ("message_filter", "code"),
    [
        (_flip_message(3), grpc.StatusCode.DATA_LOSS),
        (_drop_message(2), grpc.StatusCode.INVALID_ARGUMENT),  # a chunk missing at commit
        (_drop_message(1), grpc.StatusCode.INVALID_ARGUMENT),  # no header
    ],
)
def test_broken_transfers_free_every_reserved_block(message_filter, code):
    async def go():
        pair = Pair(SMALL, message_filter)
        await pair.server.start()
        blocks = pair.blocks(6)
        with pytest.raises(TransferError) as err:
            await pair.client.push(pair.server.address, pair.src, blocks)
        assert err.value.code == code
        assert pair.server.claim("r") is None
        pair.src.release(SENDER)
        assert pair.settled()

    run(go())


def test_duplicate_request_id_is_refused_without_touching_the_first():
    async def go():
        pair = Pair(SMALL)
        await pair.server.start()
        blocks = pair.blocks(2)
        await pair.client.push(pair.server.address, pair.src, blocks)
        with pytest.raises(TransferError) as err:
            await pair.client.push(pair.server.address, pair.src, blocks)
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        first = pair.server.claim("r")
        assert pair.dst.holders() == [first.holder]  # the refused push released its own
        pair.dst.release(first.holder)
        pair.src.release(SENDER)
        assert pair.settled()

    run(go())


def test_unclaimed_push_is_released_when_its_lease_expires():
    async def go():
        pair = Pair(SMALL)
        service = pair.server.service
        blocks = pair.blocks(3)
        await pair.server.start()
        await pair.client.push(pair.server.address, pair.src, blocks)
        assert pair.dst.num_free == pair.free[1] - 3
        assert [h.kind for h in pair.dst.holders()] == ["lease"]
        assert service.leases.expire_all() == 1
        assert pair.server.claim("r") is None and pair.dst.holders() == []
        pair.src.release(SENDER)
        await pair.server.stop()
        assert pair.settled()

    run(go())


def test_discard_frees_a_committed_push_and_refuses_a_later_one():
    async def go():
        pair = Pair(SMALL)
        await pair.server.start()
        blocks = pair.blocks(3)
        await pair.client.push(pair.server.address, pair.src, blocks)
        pair.server.discard("r")  # committed, never claimed: freed at once
        assert pair.server.claim("r") is None
        assert pair.dst.num_free == pair.free[1] and pair.dst.holders() == []
        pair.server.discard("late")  # cancelled before its push began
        with pytest.raises(TransferError) as err:
            late = dataclasses.replace(blocks, request_id="late")
            await pair.client.push(
                pair.server.address, pair.src, granted(SMALL, pair.server.address, late)
            )
        assert err.value.code == grpc.StatusCode.CANCELLED
        pair.src.release(SENDER)
        await pair.server.stop()
        assert pair.settled()

    run(go())


class Handler:
    """A PushHandler that keeps what it is given and refuses request "no"."""

    def __init__(self) -> None:
        self.pushes: list[CommittedPush] = []

    def check(self, request_id: str, decode_start: bytes) -> None:
        if request_id == "no":
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, "not for us")

    def committed(self, push: CommittedPush) -> None:
        self.pushes.append(push)


def cache_prefix(store: PoolBlockStore, tokens: list[int], n: int) -> list[bytes]:
    """Cache ``n`` full blocks of ``tokens`` in ``store`` with no reference;
    their hashes."""
    bs = store.layout.block_size
    hashes = hash_blocks(tokens[: n * bs], bs, root_hash(store.layout.model_fingerprint, bs))
    holder = Holder("request", "cached")
    blocks = store.reserve(holder, n)
    assert blocks is not None
    store.commit(blocks, hashes, tokens[: n * bs])
    store.release(holder)
    return hashes


async def handshake_push(transport: str):
    """Push 3 blocks to a receiver that holds the first 2 (same hashes and
    tokens): only the third is sent; the handler gets all three."""
    bs = LAYOUT.block_size
    tokens = list(range(100, 100 + 2 * bs + 1))
    src, dst, handler = make_store(seed=1), make_store(seed=2), Handler()
    free = (src.num_free, dst.num_free)
    hashes = cache_prefix(dst, tokens, 2)
    held = [dst.pool.block_for_hash(h) for h in hashes]
    if transport == "inproc":
        hub = InProcHub()
        server = InProcKVServer(hub, "dst", dst, SMALL, handler=handler)
        client = InProcKVClient(hub, SMALL)
    else:
        server = GrpcKVServer(dst, SMALL, handler=handler)
        client = GrpcKVClient(SMALL)
    await server.start()
    ids = src.reserve(SENDER, 3)
    blocks = granted(
        SMALL,
        server.address,
        KVBlocks("r", ids, [*hashes, None], tokens, [7], b"start", first_token=b"first"),
    )
    refused_blocks = granted(SMALL, server.address, dataclasses.replace(blocks, request_id="no"))
    try:
        result = await client.push(server.address, src, blocks)
        with pytest.raises(TransferError) as refused:
            await client.push(server.address, src, refused_blocks)
    finally:
        await client.close()
        await server.stop()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (result.held_blocks, result.bytes_sent) == (2, LAYOUT.block_bytes)
    [push] = handler.pushes
    assert push.blocks.block_ids[:2] == held and push.held_blocks == 2
    assert (push.token_ids, push.next_token_ids, push.decode_start) == (tokens, [7], b"start")
    assert push.first_token == b"first"
    received = push.blocks.block_ids[2:]
    assert torch.equal(dst.cache.read_blocks(received), src.cache.read_blocks(ids[2:]))
    assert dst.pool.block_for_hash(hashes[0]) == held[0]  # still cached, now referenced
    dst.release(push.blocks.holder)
    src.release(SENDER)
    assert (src.num_free, dst.num_free) == free
    assert src.pool.holders() == dst.pool.holders() == []


@pytest.mark.parametrize("transport", ["inproc", "grpc"])
def test_a_push_sends_only_the_blocks_the_receiver_lacks(transport):
    run(handshake_push(transport))


def test_a_refused_push_reserves_nothing():
    async def go():
        handler = Handler()
        pair = Pair(SMALL)
        pair.server = InProcKVServer(pair.hub, "dst", pair.dst, SMALL, handler=handler)
        await pair.server.start()
        blocks = pair.blocks(3, request_id="no")
        with pytest.raises(TransferError) as err:
            await pair.client.push(pair.server.address, pair.src, blocks)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert handler.pushes == [] and pair.dst.num_free == pair.free[1]
        pair.src.release(SENDER)
        await pair.server.stop()
        assert pair.settled()

    run(go())


class NotYet(Handler):
    """Refuses every push until ``ready`` (a router whose stream is not open yet)."""

    ready = False

    def check(self, request_id: str, decode_start: bytes) -> None:
        if not self.ready:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, "no stream yet")


def test_a_push_refused_by_the_handler_can_be_retried_with_its_grant_once():
    """The grant is used only once the push is admitted: a refused header does
    not burn it, and once a push with it is taken, a replay is ALREADY_EXISTS."""

    async def go():
        handler = NotYet()
        pair = Pair(SMALL)
        pair.server = InProcKVServer(pair.hub, "dst", pair.dst, SMALL, handler=handler)
        await pair.server.start()
        blocks = pair.blocks(3)
        with pytest.raises(TransferError) as err:
            await pair.client.push(pair.server.address, pair.src, blocks)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert pair.dst.num_free == pair.free[1]
        handler.ready = True
        await pair.client.push(pair.server.address, pair.src, blocks)  # the same grant
        [push] = handler.pushes
        pair.dst.release(push.blocks.holder)
        with pytest.raises(TransferError) as err:
            await pair.client.push(pair.server.address, pair.src, blocks)
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and "used" in err.value.message
        assert len(handler.pushes) == 1
        pair.src.release(SENDER)
        await pair.server.stop()
        assert pair.settled()

    run(go())


def test_pull_pins_only_while_streaming_and_returns_the_held_prefix():
    async def go():
        keeper, puller = make_store(seed=3), make_store(seed=4)
        hub = InProcHub()
        server = InProcKVServer(hub, "keeper", keeper, SMALL)
        await server.start()
        tokens = list(range(100, 100 + 3 * LAYOUT.block_size))
        hashes = hash_blocks(tokens, LAYOUT.block_size, root_hash("fp", LAYOUT.block_size))
        ids = keeper.reserve(SENDER, 3)
        keeper.commit(ids, hashes, tokens)
        keeper.release(SENDER)  # cached, no holder
        free = (keeper.num_free, puller.num_free)
        client = InProcKVClient(hub, SMALL)
        asked = [*hashes[:2], b"x" * 16, hashes[2]]
        grant = pull_grant(SMALL, server.address, "pull", asked)
        result = await client.pull(server.address, puller, asked, request_id="pull", grant=grant)
        assert result.block_hashes == hashes[:2]
        assert torch.equal(
            puller.cache.read_blocks(result.block_ids), keeper.cache.read_blocks(ids[:2])
        )
        assert puller.pool.block_for_hash(hashes[0]) == result.block_ids[0]  # indexed
        assert keeper.holders() == []  # pinned only while streaming
        assert puller.holders() == [result.holder] and result.holder.kind == "lease"
        assert puller.pool.held_by(result.holder) == result.block_ids
        puller.release(result.holder)
        await server.stop()
        assert _settled(keeper, puller, free)

    run(go())


def test_codegen_check_passes_and_detects_drift(tmp_path, monkeypatch):
    assert codegen.check() == []
    copy = tmp_path / "repo"
    shutil.copytree(codegen.PROTO_DIR, copy / "protos")
    monkeypatch.setattr(codegen, "ROOT", copy)
    monkeypatch.setattr(codegen, "PROTO_DIR", copy / "protos")
    stub = copy / "protos/tandem/v1/kv_transfer_pb2.pyi"
    stub.write_text(stub.read_text() + "\n# edited by hand\n")
    assert codegen.check() == ["protos/tandem/v1/kv_transfer_pb2.pyi"]
    assert codegen.main(["--check"]) == 1


# ---- the data channel's pieces, over a socketpair (no network) ----


@given(
    ids=st.lists(st.integers(0, 31), min_size=1, max_size=12, unique=True),
    layers=st.tuples(st.integers(0, 2), st.integers(1, 3)),
)
def test_pool_buffers_are_the_chunk_payload_in_wire_order(ids, layers):
    ls, le = min(layers[0], layers[1] - 1), layers[1]
    store = make_store(seed=5)
    size = (le - ls) * len(ids) * LAYOUT.block_bytes_per_layer
    gathered = bytearray(size)
    store.read_into(ids, ls, le, memoryview(gathered))
    views = store.buffers(ids, ls, le)
    assert b"".join(views) == gathered
    # Writing through the views is writing the blocks.
    other = make_store(seed=6)
    for view, chunk in zip(other.buffers(ids, ls, le), _split_like(views, gathered), strict=True):
        view[:] = chunk
    regathered = bytearray(size)
    other.read_into(ids, ls, le, memoryview(regathered))
    assert regathered == gathered


def _split_like(views, data):
    out, at = [], 0
    for view in views:
        out.append(data[at : at + view.nbytes])
        at += view.nbytes
    return out


def test_vectored_send_and_receive_move_every_byte():
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(0, 3000, 1500)]  # more views than one sendmsg takes
    payload = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    src = [memoryview(b) for b in _split_like([memoryview(bytes(s)) for s in sizes], payload)]
    dst = [memoryview(bytearray(s)) for s in sizes]
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=sockets.send_buffers, args=(a, src))
        sender.start()
        sockets.recv_into_buffers(b, dst)
        sender.join()
        assert b"".join(dst) == payload
        a.close()
        with pytest.raises(ConnectionError):
            sockets.recv_into_buffers(b, [memoryview(bytearray(1))])


class _Registry:
    max_frame_bytes = 64 << 20

    def unregister(self, token, incoming) -> None:
        self.unregistered = token


class DataPair:
    """A sender's DataSender and a receiver's IncomingData joined by a socketpair."""

    def __init__(self, n: int, chunk_bytes: int = 1024, frame_filter=None) -> None:
        self.src, self.dst = make_store(seed=1), make_store(seed=2)
        self.free = (self.src.num_free, self.dst.num_free)
        self.src_ids = self.src.reserve(SENDER, n)
        lease = lease_holder("send", "r")
        feed = KVFeed.ready(self.src, self.src.lock, lease, self.src_ids)  # pins, as a push does
        tokens = list(range(n * LAYOUT.block_size))
        self.sender = KVSender(feed, PushHeader("r", tokens), chunk_bytes)
        self.receiver = KVReceiver(self.dst)
        self.receiver.on_header(self.sender.header())
        self.registry = _Registry()
        self.incoming = datachannel.IncomingData(
            self.registry, b"t" * 16, self.receiver, lambda: None
        )
        self.receiver.expect_data(self.incoming)
        self.data = datachannel.DataSender(
            "", 0, b"t" * 16, self.sender, 10.0, frame_filter, PAIR_SECURITY
        )

    def run(self) -> None:
        a, b = socket.socketpair()
        assert self.incoming.attach(b)

        def send() -> None:
            with contextlib.suppress(OSError):
                self.data.start_on(a)
                self.data.send(self.sender.take()[0])
                self.data.end()

        sender = threading.Thread(target=send)
        sender.start()
        tag, size = datachannel.HANDSHAKE_TAG, datachannel.TOKEN_BYTES
        audience = handshake.tcp_audience("", 0)  # the DataSender's host and port
        assert handshake.accept(b, PAIR_SECURITY, tag, audience, size) == b"t" * 16
        self.incoming.serve(b)
        sender.join()

    def close(self) -> None:
        self.sender.close()
        self.src.release(SENDER)

    def settled(self) -> bool:
        return _settled(self.src, self.dst, self.free)


def test_data_channel_fills_the_reserved_blocks():
    async def go():
        pair = DataPair(5)
        await asyncio.to_thread(pair.run)
        await pair.receiver.drain()
        held = pair.receiver.commit()
        assert torch.equal(
            pair.dst.cache.read_blocks(held.block_ids), pair.src.cache.read_blocks(pair.src_ids)
        )
        assert pair.sender.bytes_sent == pair.receiver.bytes_received == 5 * LAYOUT.block_bytes
        pair.dst.release(held.holder)
        pair.close()
        assert pair.settled()

    run(go())


@pytest.mark.parametrize(
    ("frame_filter", "code"),
    [
        (_flip_message(2), grpc.StatusCode.DATA_LOSS),
        (_drop_message(2), grpc.StatusCode.INVALID_ARGUMENT),  # a chunk missing at commit
        (lambda msg: bytes(len(msg)), grpc.StatusCode.INVALID_ARGUMENT),  # not a frame
    ],
)
def test_broken_data_connection_fails_and_frees_the_blocks(frame_filter, code):
    async def go():
        pair = DataPair(6, frame_filter=frame_filter)
        await asyncio.to_thread(pair.run)
        with pytest.raises(TransferError) as err:
            await pair.receiver.drain()
            pair.receiver.commit()
        assert err.value.code == code
        pair.receiver.fail()
        pair.close()
        assert pair.settled()

    run(go())


def test_failing_before_the_data_connection_arrives_frees_the_blocks():
    async def go():
        pair = DataPair(3)
        pair.receiver.fail()
        assert pair.incoming.done.done() and pair.registry.unregistered == b"t" * 16
        assert not pair.incoming.attach(socket.socketpair()[0])
        pair.close()
        assert pair.settled()

    run(go())


def test_failing_mid_connection_frees_the_blocks_only_after_the_thread_stops():
    async def go():
        pair = DataPair(4)
        a, b = socket.socketpair()
        assert pair.incoming.attach(b)
        serving = asyncio.get_running_loop().run_in_executor(None, pair.incoming.serve, b)
        pair.receiver.fail()  # the thread may still write into the blocks: release deferred
        assert pair.dst.num_free == pair.free[1] - 4
        assert pair.dst.holders() == [pair.receiver.holder]
        await serving
        with pytest.raises(TransferError):
            pair.incoming.done.result()
        await asyncio.sleep(0)  # the deferred release runs on the loop
        a.close()
        pair.close()
        assert pair.settled()

    run(go())


def test_transfer_error_survives_pickling():
    """Ray pickles a worker's exception for the router: it must come back whole."""
    import pickle

    err = pickle.loads(pickle.dumps(TransferError(grpc.StatusCode.DATA_LOSS, "bad chunk")))
    assert (err.code, err.message) == (grpc.StatusCode.DATA_LOSS, "bad chunk")
    assert str(err) == "DATA_LOSS: bad chunk"
