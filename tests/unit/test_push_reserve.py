"""A decode worker's push reserve (decode_pool/reserve.py) remembers a push
that is still waiting for room: its header's tries push its forgetting back,
so its growth is reserved once it fits, however long it waited."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from decode_pool import reserve as reserve_mod
from decode_pool.reserve import PushReserve
from engine.block_pool import BlockPool, Holder
from engine.hashing import root_hash
from engine.scheduler import Scheduler
from kv_transfer.lease import lease_holder

pytestmark = pytest.mark.unit

BS = 2
FORGET_S = 10.0  # transfer.lease_s on a worker


def test_a_push_waiting_for_room_longer_than_forget_after_keeps_its_growth(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(reserve_mod.time, "monotonic", lambda: clock[0])
    pool = BlockPool(10, BS)
    sched = Scheduler(pool, root_hash("m", BS), 64, 8, enable_prefix_caching=False)
    reserve = PushReserve(
        SimpleNamespace(block_pool=pool, scheduler=sched, max_model_len=0), FORGET_S
    )
    other = Holder("request", "running")
    taken = pool.allocate(other, 8)  # room for 2 blocks
    start = SimpleNamespace(num_prompt_tokens=4, params=SimpleNamespace(max_tokens=5))
    reserve.expect("r1", start)  # 4 blocks at its longest; its header brings 2
    holder = lease_holder("recv", "r1")
    for t in range(1, 16):  # the header waits (and asks again) past FORGET_S
        clock[0] = float(t)
        assert not reserve.admit(holder, 2)  # 2 + 2 of growth > 2 free
        assert reserve.pending() == 0  # holds nothing yet
    pool.release(other, taken[:4])  # room for 6 now
    assert reserve.admit(holder, 2)
    pool.allocate(holder, 2)
    assert reserve.pending() == 2  # its growth to 4 blocks is still promised
    assert sched.room() == 6 - 2 - 2
    pool.release(holder)
    pool.release(other)
    assert pool.num_free == 10
