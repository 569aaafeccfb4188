"""The admission queue's policy: order, priorities, bounds; the rooms' sums."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.admission import (
    AdmissionQueue,
    Admitted,
    Admitter,
    KVRooms,
    QueueFull,
    Room,
    longest_blocks,
)
from router.messages import RequestError

pytestmark = pytest.mark.unit


def test_higher_priority_first_then_first_come_first_served():
    q: AdmissionQueue[str] = AdmissionQueue(max_waiting=8)
    for name, prio in [("a", 0), ("b", 1), ("c", 0), ("d", 2), ("e", 1)]:
        q.push(name, prio)
    assert q.admit(lambda _: True) == ["d", "b", "e", "a", "c"]
    assert len(q) == 0


def test_no_overtaking_a_head_that_does_not_fit():
    q: AdmissionQueue[int] = AdmissionQueue(max_waiting=8)
    for blocks in (5, 1, 1):
        q.push(blocks, 0)
    room = [3]

    def start(blocks: int) -> bool:
        if blocks > room[0]:
            return False
        room[0] -= blocks
        return True

    assert q.admit(start) == []  # the head needs 5: the small ones wait behind it
    room[0] = 7
    assert q.admit(start) == [5, 1, 1]


def test_the_bound_counts_waiting_requests_only():
    q: AdmissionQueue[str] = AdmissionQueue(max_waiting=2)
    first = q.push("a", 0)
    q.push("b", 0)
    with pytest.raises(QueueFull):
        q.push("c", 0)
    q.remove(first)
    q.remove(first)  # twice: counted once
    q.push("c", 0)
    assert len(q) == 2
    assert q.admit(lambda _: True) == ["b", "c"]


def test_a_new_request_goes_first_only_above_every_waiting_priority():
    q: AdmissionQueue[str] = AdmissionQueue(max_waiting=4)
    assert q.may_go_first(0)
    q.push("a", 1)
    assert not q.may_go_first(0)
    assert not q.may_go_first(1)  # equal priority: behind the earlier one
    assert q.may_go_first(2)


def test_rooms_less_what_was_promised():
    rooms = KVRooms()
    assert rooms.free("d0") is None
    rooms.report("d0", Room(free_blocks=10, total_blocks=16))
    rooms.promise("d0", 4)
    rooms.promise("d0", 3)
    assert rooms.free("d0") == 3
    rooms.settle("d0", 4)
    assert rooms.free("d0") == 7
    rooms.report("d0", Room(free_blocks=2, total_blocks=16))
    assert rooms.free("d0") == -1
    rooms.settle("d0", 5)  # more than left: nothing promised
    assert (rooms.free("d0"), rooms.total("d0")) == (2, 16)
    rooms.forget("d0")
    assert rooms.free("d0") is None


def test_longest_blocks_counts_max_tokens_within_max_model_len():
    assert longest_blocks(16, 1, 0, 16) == 1  # the sampled token is never computed
    assert longest_blocks(16, 2, 0, 16) == 2
    assert longest_blocks(30, 100, 64, 16) == 4


def _router(free: list[int], order: list[str], name: str, blocks: int):
    def route() -> Admitted[str] | None:
        if blocks > free[0]:
            return None
        free[0] -= blocks
        order.append(name)
        return Admitted(name, "d0", blocks)

    return route


def test_waiters_start_on_reports_in_priority_order_and_leave_on_deadline():
    asyncio.run(_waiters())


async def _waiters():
    adm = Admitter(max_waiting=3)
    free, order = [0], []
    low = asyncio.ensure_future(adm.admit(_router(free, order, "low", 2), 0))
    gone = asyncio.ensure_future(adm.admit(_router(free, order, "gone", 1), 0))
    await asyncio.sleep(0)
    high = asyncio.ensure_future(adm.admit(_router(free, order, "high", 2), 5))
    await asyncio.sleep(0)
    assert len(adm.queue) == 3
    with pytest.raises(RequestError) as info:
        await adm.admit(_router(free, order, "full", 1), 0)
    assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limits.max_waiting_requests" in info.value.message
    gone.cancel()  # its deadline passed
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(adm.queue) == 2
    free[0] = 2
    adm.wake()
    assert (await high).route == "high"
    assert not low.done()
    free[0] = 2
    adm.wake()
    assert (await low).route == "low"
    assert order == ["high", "low"]
    assert len(adm.queue) == 0


def test_a_request_that_fits_and_has_no_one_ahead_goes_at_once():
    asyncio.run(_at_once())


async def _at_once():
    adm = Admitter(max_waiting=0)  # no waiting at all
    free, order = [4], []
    got = await adm.admit(_router(free, order, "a", 3), 0)
    assert (got.route, free[0]) == ("a", 1)
    with pytest.raises(RequestError):
        await adm.admit(_router(free, order, "b", 3), 0)
