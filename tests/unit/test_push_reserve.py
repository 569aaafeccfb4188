"""A decode worker's push reserve (decode_pool/reserve.py): the growth it
promises for the pushes in flight, kept as a running count as their leases
change (a header's blocks granted, a lease expiring, a commit handing the
blocks to the request), and a push still waiting for room remembered: its
header's tries push its forgetting back, so its growth is reserved once it
fits, however long it waited."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from decode_pool import reserve as reserve_mod
from decode_pool.reserve import PushReserve
from engine.block_pool import Holder
from engine.hashing import root_hash
from engine.scheduler import Scheduler
from kv_transfer import KVBlocks, TransferConfig
from kv_transfer.lease import lease_holder
from kv_transfer.pool_store import PoolBlockStore
from tests.kv_grants import granted
from tests.kv_inproc import InProcHub, InProcKVClient, InProcKVServer
from tests.pool_checks import leftover_holders
from tests.unit.test_kv_transfer_pieces import LAYOUT, make_store

pytestmark = pytest.mark.unit

BS = LAYOUT.block_size  # 4 tokens a block
FORGET_S = 10.0  # transfer.lease_s on a worker
SENDER = Holder("request", "sender")


def _start(prompt: int, max_tokens: int) -> SimpleNamespace:
    """What ``expect`` reads of a push's DecodeStart."""
    return SimpleNamespace(num_prompt_tokens=prompt, params=SimpleNamespace(max_tokens=max_tokens))


def _reserve(store: PoolBlockStore) -> tuple[PushReserve, Scheduler]:
    """A reserve hooked to ``store`` as a decode worker hooks it."""
    pool = store.pool
    sched = Scheduler(pool, root_hash("m", BS), 64, 8, enable_prefix_caching=False)
    engine = SimpleNamespace(block_pool=pool, scheduler=sched, max_model_len=0)
    reserve = PushReserve(engine, FORGET_S)
    store.admit, store.on_held = reserve.admit, reserve.held
    return reserve, sched


def test_a_push_waiting_for_room_longer_than_forget_after_keeps_its_growth(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(reserve_mod.time, "monotonic", lambda: clock[0])
    store = make_store(10)
    pool = store.pool
    reserve, sched = _reserve(store)
    other = Holder("request", "running")
    taken = pool.allocate(other, 8)  # room for 2 blocks
    reserve.expect("r1", _start(8, 9))  # 4 blocks at its longest; its header brings 2
    holder = lease_holder("recv", "r1")
    for t in range(1, 16):  # the header waits (and asks again) past FORGET_S
        clock[0] = float(t)
        assert store.reserve(holder, 2) is None  # 2 + 2 of growth > 2 free
        assert reserve.pending() == 0  # holds nothing yet
    pool.release(other, taken[:4])  # room for 6 now
    assert store.reserve(holder, 2) is not None
    assert reserve.pending() == 2  # its growth to 4 blocks is still promised
    assert sched.room() == 6 - 2 - 2
    store.release(holder)
    assert reserve.pending() == 0
    pool.release(other)
    assert pool.num_free == 10


def test_the_reserve_follows_its_pushes_leases_through_grant_expiry_and_commit():
    """Real pushes through the in-process mover into a 16-block pool: each
    header's blocks count from the grant, an expired lease's come back, a
    committed push's growth goes to the scheduler with its request."""
    config = TransferConfig(chunk_bytes=1024)
    src, dst = make_store(32, seed=1), make_store(16, seed=2)
    reserve, sched = _reserve(dst)
    hub = InProcHub()
    server = InProcKVServer(hub, "dst", dst, config)
    client = InProcKVClient(hub, config)

    async def push(request_id: str, n: int) -> None:
        ids = src.reserve(SENDER, n)
        blocks = KVBlocks(request_id, ids, [None] * n, list(range(n * BS)))
        await client.push(server.address, src, granted(config, server.address, blocks))

    async def go() -> None:
        await server.start()
        reserve.expect("r1", _start(8, 9))  # 4 blocks at its longest
        reserve.expect("r2", _start(8, 17))  # 6
        assert (reserve.pending(), sched.room()) == (0, 16)  # nothing granted yet
        await push("r1", 2)  # granted 2 blocks: grows by 2 more
        assert (reserve.pending(), dst.num_free, sched.room()) == (2, 14, 12)
        # The same tokens: its first block is r1's, held from the cache
        # (hold_prefix), its second new. It holds 2 and grows by 4.
        await push("r2", 2)
        assert (reserve.pending(), dst.num_free, sched.room()) == (6, 13, 7)

        # A header that does not fit the room left is refused: nothing changes.
        reserve.expect("r3", _start(8, 25))  # 8 at its longest: 2 + 6 > 7
        assert dst.reserve(lease_holder("recv", "r3"), 2) is None
        assert (reserve.pending(), dst.num_free, sched.room()) == (6, 13, 7)

        # r1 commits: the request takes its blocks, the scheduler its growth.
        held = server.claim("r1")
        reserve.settled("r1")
        assert (reserve.pending(), sched.room()) == (4, 9)
        dst.pool.release_held([held])  # (the request ends; r2 still holds block 0)
        assert (reserve.pending(), dst.num_free, sched.room()) == (4, 14, 10)

        # r2 is never claimed: its lease expires and its blocks come back.
        assert server.service.leases.expire_all() == 1
        assert (reserve.pending(), dst.num_free, sched.room()) == (0, 16, 16)

        # r3 fits now (one block from the cache, one new); the room it
        # promises goes when its push is dropped.
        await push("r3", 2)
        assert (reserve.pending(), dst.num_free, sched.room()) == (6, 14, 8)
        server.discard("r3")
        assert (reserve.pending(), dst.num_free, sched.room()) == (0, 16, 16)
        await server.stop()

    asyncio.run(go())
    src.release(SENDER)
    assert leftover_holders(dst.pool) == [] and dst.num_free == 16


def test_pending_is_a_count_the_scheduler_reads_without_walking_the_pushes(monkeypatch):
    store = make_store(16)
    reserve, _ = _reserve(store)
    holders = []
    for i in range(4):
        reserve.expect(f"r{i}", _start(8, 9))  # 4 blocks each at the longest
        holders.append(lease_holder("recv", f"r{i}"))
        assert store.reserve(holders[-1], 2) is not None
    calls = []
    held_by = store.pool.held_by
    monkeypatch.setattr(store.pool, "held_by", lambda h: calls.append(h) or held_by(h))
    assert [reserve.pending() for _ in range(100)] == [8] * 100
    assert calls == []  # per step: no walk over the pushes' holders
    store.release(holders[0])
    assert reserve.pending() == 6
    for holder in holders[1:]:
        store.release(holder)
    assert reserve.pending() == 0
