"""The router's tries against admission by KV room (router/ray_backend.py
``generate``, router/route_admission.py, router/worker_changes.py
``worker_down``): a push that found no room is not a failed try, a lost
worker wakes the requests waiting for room, and a request after a failed
try takes an avoided worker with room rather than wait for another. Fake
actors and streams, as in tests/unit/test_request_tries.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kv_transfer import TransferError
from kv_transfer.interface import NO_ROOM_WAIT, PushNoRoom
from protocol.requests import PrefillResult
from router.admission import Room
from router.messages import RequestError
from tests.unit.test_request_tries import (
    Setup,
    Try,
    assert_clean,
    collect,
    make_backend,
    run,
    settle,
)

pytestmark = pytest.mark.unit

TOTAL = 100  # blocks per fake decode worker; the request needs 3


def _report(setup: Setup, **free: int) -> None:
    for name, blocks in free.items():
        setup.backend.admission.report(name, Room(blocks, TOTAL))


async def _serve(t: Try) -> PrefillResult:
    t.push(31)
    t.push(32, finished=True, reason="stop")
    return t.result()


def test_a_push_without_room_queues_again_and_is_not_a_failed_try():
    attempts = 4 + 2  # more than tuning.max_attempts (4): none of them counts

    async def no_room(t: Try) -> PrefillResult:
        raise PushNoRoom(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{NO_ROOM_WAIT}: no room for 3")

    setup = make_backend([no_room] * attempts + [_serve])
    assert setup.backend.retry.max_attempts < attempts + 1
    _report(setup, d0=TOTAL, d1=TOTAL)

    async def main():
        out = await collect(setup)
        await settle(setup)
        return out

    tokens, result = run(main())
    assert tokens == [31, 32] and result.finish_reason == "stop"
    assert len(setup.cluster.tries) == attempts + 1
    stats = setup.backend.failover
    assert (stats.retries, stats.failed, stats.no_room) == (0, 0, attempts)
    rooms = setup.backend.admission.rooms
    assert (rooms.free("d0"), rooms.free("d1")) == (TOTAL, TOTAL)  # every promise settled
    assert_clean(setup)


def test_a_worker_leaving_routing_wakes_the_requests_waiting_for_room():
    setup = make_backend([])
    _report(setup, d0=0, d1=0)  # no room anywhere: the request waits
    backend = setup.backend

    async def main():
        task = asyncio.ensure_future(collect(setup))
        while len(backend.admission.queue) == 0:
            await asyncio.sleep(0)
        for w in setup.decode:  # both leave routing (the last one down wakes the queue)
            backend.decode.workers.remove(w)
            await backend.changes.worker_down(w)
        with pytest.raises(RequestError) as err:
            await task  # not at its deadline: now
        return err.value

    err = run(main())
    assert err.code == grpc.StatusCode.UNAVAILABLE  # none will come back
    assert len(backend.admission.queue) == 0
    assert setup.cluster.tries == []


def test_after_a_failed_try_an_avoided_worker_with_room_beats_waiting():
    async def fail(t: Try) -> PrefillResult:
        # The other decode worker fills up meanwhile: only this one has room.
        other = "d1" if t.decode_worker == "d0" else "d0"
        _report(setup, **{other: 0})
        raise TransferError(grpc.StatusCode.UNAVAILABLE, "decode worker unreachable")

    setup = make_backend([fail, _serve])
    _report(setup, d0=TOTAL, d1=TOTAL)

    async def main():
        out = await collect(setup)
        await settle(setup)
        return out

    tokens, _ = run(main())
    first, second = setup.cluster.tries
    assert tokens == [31, 32]
    assert second.decode_worker == first.decode_worker  # avoided, but the one with room
    assert setup.backend.failover.retries == 1
    assert_clean(setup)
