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

from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import BlockPool, KVCache, KVLayout
from kv_transfer import (
    InProcHub,
    InProcKVClient,
    InProcKVServer,
    KVBlocks,
    PoolBlockStore,
    TransferConfig,
    TransferError,
    datachannel,
    wire,
)
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from net import sockets
from net.security import ClusterSecurity
from protos import codegen
from protos.tandem.v1 import kv_transfer_pb2 as pb

pytestmark = pytest.mark.unit

LAYOUT = KVLayout("fp", "float32", 3, 4, 2, 8)  # 512 bytes per block and layer


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
    assert wire.decode(wire.encode_commit()) is wire.COMMIT
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
        self.server = InProcKVServer(self.hub, "dst", self.dst, config)
        self.client = InProcKVClient(self.hub, config, message_filter)
        self.free = (self.src.num_free, self.dst.num_free)

    def blocks(self, n: int, request_id: str = "r") -> KVBlocks:
        ids = self.src.reserve(n)
        assert ids is not None
        return KVBlocks(request_id, ids, [None] * n, [])

    def settled(self) -> bool:
        return (self.src.num_free, self.dst.num_free) == self.free


def run(coro):
    return asyncio.run(coro)


SMALL = TransferConfig(chunk_bytes=1024)


def test_push_claim_copies_blocks_exactly():
    async def go():
        pair = Pair(SMALL)
        await pair.server.start()
        blocks = pair.blocks(5)
        result = await pair.client.push(pair.server.address, pair.src, blocks)
        claimed = pair.server.claim("r")
        assert claimed == result.remote_block_ids and pair.server.claim("r") is None
        assert torch.equal(
            pair.dst.cache.read_blocks(claimed), pair.src.cache.read_blocks(blocks.block_ids)
        )
        assert result.bytes_sent == 5 * LAYOUT.block_bytes
        pair.dst.release(claimed)
        pair.src.release(blocks.block_ids)
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
        pair.src.release(blocks.block_ids)
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
        pair.src.release(blocks.block_ids)
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
        pair.dst.release(pair.server.claim("r"))
        pair.src.release(blocks.block_ids)
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
        assert service.leases.expire_all() == 1
        assert pair.server.claim("r") is None
        pair.src.release(blocks.block_ids)
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
        assert pair.dst.num_free == pair.free[1]
        pair.server.discard("late")  # cancelled before its push began
        with pytest.raises(TransferError) as err:
            await pair.client.push(
                pair.server.address, pair.src, dataclasses.replace(blocks, request_id="late")
            )
        assert err.value.code == grpc.StatusCode.CANCELLED
        pair.src.release(blocks.block_ids)
        await pair.server.stop()
        assert pair.settled()

    run(go())


def test_committed_waits_for_the_commit_and_hands_over_the_next_tokens():
    async def go():
        pair = Pair(SMALL)
        await pair.server.start()
        waiting = asyncio.ensure_future(pair.server.committed("r"))
        await asyncio.sleep(0)
        assert not waiting.done()
        blocks = dataclasses.replace(pair.blocks(3), next_token_ids=[42])
        await pair.client.push(pair.server.address, pair.src, blocks)
        assert await waiting == [42]
        assert await pair.server.committed("r") == [42]  # committed already: no wait
        held = pair.server.claim("r")  # the wait leaves the blocks to claim
        assert held is not None and len(held) == 3
        pair.dst.release(held)
        pair.src.release(blocks.block_ids)
        await pair.server.stop()
        assert pair.settled()

    run(go())


def test_a_discard_or_a_stop_ends_the_wait_for_a_commit():
    async def go():
        pair = Pair(SMALL)
        await pair.server.start()
        discarded = asyncio.ensure_future(pair.server.committed("gone"))
        stopped = asyncio.ensure_future(pair.server.committed("never"))
        await asyncio.sleep(0)
        pair.server.discard("gone")
        with pytest.raises(LookupError, match="discarded"):
            await discarded
        with pytest.raises(LookupError, match="discarded"):  # refused: no wait at all
            await pair.server.committed("gone")
        cancelled = asyncio.ensure_future(pair.server.committed("cancelled"))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        # The cancelled wait is gone: a new one may begin (a second wait at
        # once is refused: RuntimeError).
        again = asyncio.ensure_future(pair.server.committed("cancelled"))
        await asyncio.sleep(0)
        assert not again.done()
        await pair.server.stop()
        for waiting in (stopped, again):
            with pytest.raises(LookupError):
                await waiting
        assert pair.settled()

    run(go())


def test_pull_pins_only_while_streaming_and_returns_the_held_prefix():
    async def go():
        holder, puller = make_store(seed=3), make_store(seed=4)
        hub = InProcHub()
        server = InProcKVServer(hub, "holder", holder, SMALL)
        await server.start()
        tokens = list(range(100, 100 + 3 * LAYOUT.block_size))
        hashes = hash_blocks(tokens, LAYOUT.block_size, root_hash("fp", LAYOUT.block_size))
        ids = holder.reserve(3)
        holder.commit(ids, hashes, tokens)
        holder.release(ids)  # cached, ref 0
        free = (holder.num_free, puller.num_free)
        client = InProcKVClient(hub, SMALL)
        result = await client.pull(server.address, puller, [*hashes[:2], b"x" * 16, hashes[2]])
        assert result.block_hashes == hashes[:2]
        assert torch.equal(
            puller.cache.read_blocks(result.block_ids), holder.cache.read_blocks(ids[:2])
        )
        assert puller.pool.block_for_hash(hashes[0]) == result.block_ids[0]  # indexed
        puller.release(result.block_ids)
        await server.stop()
        assert (holder.num_free, puller.num_free) == free

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
        self.src_ids = self.src.reserve(n)
        self.src.pin(self.src_ids)  # as a client's push does
        self.sender = KVSender(self.src, "r", self.src_ids, [None] * n, [], chunk_bytes)
        self.receiver = KVReceiver(self.dst)
        self.receiver.on_header(self.sender.header())
        self.registry = _Registry()
        self.incoming = datachannel.IncomingData(
            self.registry, b"t" * 16, self.receiver, lambda: None
        )
        self.receiver.expect_data(self.incoming)
        self.data = datachannel.DataSender("", 0, b"t" * 16, self.sender, 10.0, frame_filter)

    def run(self, skip_preamble: bool = True) -> None:
        a, b = socket.socketpair()
        assert self.incoming.attach(b)

        def send() -> None:
            with contextlib.suppress(OSError):
                self.data.send_on(a)

        sender = threading.Thread(target=send)
        sender.start()
        preamble = memoryview(bytearray(20 + 32))
        sockets.recv_exact(b, preamble)
        mac = ClusterSecurity().token_mac(b"t" * 16)
        assert bytes(preamble) == b"TKV1" + b"t" * 16 + mac
        self.incoming.serve(b)
        sender.join()

    def close(self) -> None:
        self.sender.close()
        self.src.release(self.src_ids)


def test_data_channel_fills_the_reserved_blocks():
    async def go():
        pair = DataPair(5)
        await asyncio.to_thread(pair.run)
        await pair.receiver.drain()
        blocks = pair.receiver.commit()
        assert torch.equal(
            pair.dst.cache.read_blocks(blocks), pair.src.cache.read_blocks(pair.src_ids)
        )
        assert pair.sender.bytes_sent == pair.receiver.bytes_received == 5 * LAYOUT.block_bytes
        pair.dst.release(blocks)
        pair.close()
        assert (pair.src.num_free, pair.dst.num_free) == pair.free

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
        assert (pair.src.num_free, pair.dst.num_free) == pair.free

    run(go())


def test_failing_before_the_data_connection_arrives_frees_the_blocks():
    async def go():
        pair = DataPair(3)
        pair.receiver.fail()
        assert pair.incoming.done.done() and pair.registry.unregistered == b"t" * 16
        assert not pair.incoming.attach(socket.socketpair()[0])
        pair.close()
        assert (pair.src.num_free, pair.dst.num_free) == pair.free

    run(go())


def test_failing_mid_connection_frees_the_blocks_only_after_the_thread_stops():
    async def go():
        pair = DataPair(4)
        a, b = socket.socketpair()
        assert pair.incoming.attach(b)
        serving = asyncio.get_running_loop().run_in_executor(None, pair.incoming.serve, b)
        pair.receiver.fail()  # the thread may still write into the blocks: release deferred
        assert pair.dst.num_free == pair.free[1] - 4
        await serving
        with pytest.raises(TransferError):
            pair.incoming.done.result()
        await asyncio.sleep(0)  # the deferred release runs on the loop
        a.close()
        pair.close()
        assert (pair.src.num_free, pair.dst.num_free) == pair.free

    run(go())


def test_transfer_error_survives_pickling():
    """Ray pickles a worker's exception for the router: it must come back whole."""
    import pickle

    err = pickle.loads(pickle.dumps(TransferError(grpc.StatusCode.DATA_LOSS, "bad chunk")))
    assert (err.code, err.message) == (grpc.StatusCode.DATA_LOSS, "bad chunk")
    assert str(err) == "DATA_LOSS: bad chunk"
