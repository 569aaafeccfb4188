"""A push that streams KV as it is computed (kv_transfer/feed.py): the feed
hands each block over once every layer it covers holds all its tokens,
pinned from the report on; the movers send what is ready before the final
exists; a stream abandoned or stalled half-way frees every block on both
sides. Driven by hand here (a prefill's engine reports the same way:
tests/unit/test_streamed_prefill.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from engine.block_pool import Holder
from kv_transfer import GrpcKVClient, GrpcKVServer, TransferConfig, TransferError
from kv_transfer.feed import Final, KVFeed
from kv_transfer.interface import PushHeader
from tests.kv_grants import push_grant
from tests.kv_inproc import InProcHub, InProcKVClient, InProcKVServer
from tests.unit.test_kv_transfer_pieces import LAYOUT, Handler, make_store

pytestmark = pytest.mark.unit

BS = LAYOUT.block_size  # 4 tokens a block, 3 layers
REQUEST = Holder("request", "r")  # the blocks as the computing request holds them
FINAL = Final((7,), b"first")


def test_a_feed_hands_over_each_block_once_its_layers_hold_all_its_tokens():
    store = make_store()
    free = store.num_free
    table = store.reserve(REQUEST, 3)
    feed = KVFeed.for_request(store, store.lock, "r", 10)  # 3 blocks, the last one partial
    assert (feed.num_blocks, feed.take()) == (3, ([], None))
    feed.progress(table, 0, 6, 1)  # layer 0 holds 6 tokens: block 0 there
    assert feed.take() == ([(0, 1, 0, 1)], None) and feed.started
    feed.progress(table, 0, 6, 3)
    assert feed.take() == ([(1, 3, 0, 1)], None)
    feed.progress(table, 6, 10, 2)  # every token in layers 0-1: the partial block too
    assert feed.take() == ([(0, 2, 1, 3)], None)
    assert feed.block_ids == table
    store.release(REQUEST)  # the request lets go (a preemption): the feed still pins them
    assert store.num_free == free - 3
    feed.finish(None, FINAL)  # every block was reported
    assert feed.take() == ([(2, 3, 1, 3)], FINAL)
    assert feed.take() == ([], FINAL)
    feed.close()
    feed.close()
    assert store.num_free == free and store.holders() == []


def test_a_feed_skips_what_the_receiver_holds_and_pins_what_it_lacks_at_the_finish():
    store = make_store()
    free = store.num_free
    table = store.reserve(REQUEST, 3)
    feed = KVFeed.for_request(store, store.lock, "r", 12)
    feed.progress(table, 0, 4, 3)
    feed.skip(2)
    assert feed.take() == ([], None)
    feed.finish(table, FINAL)  # the rest was never reported: pinned now
    assert feed.take() == ([(0, 3, 2, 3)], FINAL)
    store.release(REQUEST)
    feed.close()
    assert store.num_free == free and store.holders() == []


def test_a_feed_finished_before_any_report_moves_no_block_and_a_failed_one_raises():
    store = make_store()
    feed = KVFeed.for_request(store, store.lock, "r", 10)
    feed.finish(None, FINAL)  # the first token ended the request: nothing was pinned
    assert (feed.num_blocks, feed.take()) == (0, ([], FINAL))
    failed = KVFeed.for_request(store, store.lock, "f", 10)
    failed.fail(TransferError(grpc.StatusCode.CANCELLED, "gone"))
    with pytest.raises(TransferError):
        failed.take()
    with pytest.raises(TransferError):
        asyncio.run(failed.wait_started())
    feed.close()
    failed.close()
    assert store.holders() == []


class Stream:
    """A push streamed from ``src`` to a server over ``dst``, its blocks
    reported by hand as a prefill's engine would."""

    def __init__(self, transport: str, num_tokens: int, config: TransferConfig) -> None:
        self.src, self.dst = make_store(seed=1), make_store(seed=2)
        self.free = (self.src.num_free, self.dst.num_free)
        self.handler = Handler()
        self.config = config
        self.frames: list[int] = []  # sizes of the messages (or data frames) sent
        if transport == "inproc":
            hub = InProcHub()
            self.server = InProcKVServer(hub, "dst", self.dst, config, handler=self.handler)
            self.client = InProcKVClient(hub, config, message_filter=self._seen)
        else:
            data = transport == "data"
            config = TransferConfig(
                lease_s=config.lease_s,
                reap_interval_s=config.reap_interval_s,
                chunk_bytes=config.chunk_bytes,
                data_channel=data,
                timeout_s=config.timeout_s,
                security=config.security,
            )
            self.server = GrpcKVServer(self.dst, config, handler=self.handler)
            self.client = GrpcKVClient(config, message_filter=self._seen)
        self.num_tokens = num_tokens
        self.table = self.src.reserve(REQUEST, -(-num_tokens // BS))
        self.feed = KVFeed.for_request(self.src, self.src.lock, "r", num_tokens)

    def _seen(self, msg: bytes) -> bytes:
        self.frames.append(len(msg))
        return msg

    async def start(self) -> asyncio.Task:
        await self.server.start()
        tokens = list(range(100, 100 + self.num_tokens))
        grant = push_grant(self.config, self.server.address, "r")
        header = PushHeader("r", tokens, decode_start=b"start", grant=grant)
        return asyncio.ensure_future(self.client.stream(self.server.address, header, self.feed))

    async def until(self, frames: int) -> None:
        """Until ``frames`` messages went out (the header is the first)."""
        async with asyncio.timeout(60):
            while len(self.frames) < frames:
                await asyncio.sleep(0.01)

    async def settled(self) -> None:
        """Until both pools are as they were (their blocks all freed)."""
        async with asyncio.timeout(60):
            while (self.src.num_free, self.dst.num_free) != self.free or self.dst.holders():
                await asyncio.sleep(0.02)
        assert self.src.holders() == []

    async def close(self) -> None:
        await self.client.close()
        await self.server.stop()


TRANSPORTS = ["inproc", "data", "grpc"]
CONFIG = TransferConfig(chunk_bytes=1024, timeout_s=30)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_streamed_push_sends_kv_before_the_final_and_arrives_whole(transport):
    async def go():
        s = Stream(transport, 22, CONFIG)  # 6 blocks
        push = await s.start()
        s.feed.progress(s.table, 0, 8, 1)  # blocks 0-1 of layer 0
        await s.until(2)  # the header and a chunk are out, no final yet
        s.feed.progress(s.table, 0, 8, 3)
        s.feed.progress(s.table, 8, 22, 3)
        s.feed.finish(None, FINAL)
        result = await push
        [pushed] = s.handler.pushes
        assert (pushed.next_token_ids, pushed.first_token) == ([7], b"first")
        assert result.bytes_sent == 6 * LAYOUT.block_bytes
        received = s.dst.cache.read_blocks(pushed.blocks.block_ids)
        assert torch.equal(received, s.src.cache.read_blocks(s.table))
        s.dst.release(pushed.blocks.holder)
        s.src.release(REQUEST)
        await s.settled()
        await s.close()

    asyncio.run(go())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stream_abandoned_half_way_frees_every_block_on_both_sides(transport):
    """The sender goes away mid-push (its task cancelled, its call and data
    connection dropped) while its prefill still runs."""

    async def go():
        s = Stream(transport, 22, CONFIG)
        push = await s.start()
        s.feed.progress(s.table, 0, 8, 3)
        await s.until(2)
        assert s.dst.num_free < s.free[1]  # the receiver reserved the blocks
        push.cancel()
        await asyncio.wait([push])
        s.src.release(REQUEST)  # the request itself goes
        await s.settled()
        assert s.handler.pushes == []
        await s.close()

    asyncio.run(go())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stream_stalled_half_way_is_freed_by_the_receivers_lease(transport):
    """The sender stays alive but its prefill stops: the receiver's lease
    frees its blocks; the push fails once the sender moves again."""
    config = TransferConfig(chunk_bytes=1024, lease_s=0.5, reap_interval_s=0.05, timeout_s=30)

    async def go():
        s = Stream(transport, 22, config)
        push = await s.start()
        s.feed.progress(s.table, 0, 8, 3)
        await s.until(2)
        async with asyncio.timeout(60):
            while s.dst.num_free != s.free[1] or s.dst.holders():
                await asyncio.sleep(0.02)
        assert not push.done()  # waiting for the prefill, whose blocks stay pinned here
        s.feed.progress(s.table, 8, 22, 3)
        s.feed.finish(None, FINAL)
        with pytest.raises(TransferError) as err:
            await push
        assert err.value.code in (grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED)
        s.src.release(REQUEST)
        await s.settled()
        await s.close()

    asyncio.run(go())
