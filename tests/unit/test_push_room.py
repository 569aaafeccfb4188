"""A push whose blocks do not fit waits for room instead of failing, holding
nothing while it waits; one that could never fit is refused at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.block_pool import Holder
from kv_transfer import GrpcKVClient, TransferConfig, TransferError
from kv_transfer.interface import PushNoRoom
from net.security import ClusterSecurity
from router.failover import is_no_room
from tests.kv_harness import KVServerHarness, make_store

pytestmark = pytest.mark.unit

SENDER = Holder("request", "sender")
OTHER = Holder("request", "running")  # what the receiving pool is full of
CONFIG = TransferConfig(security=ClusterSecurity.generate(), lease_s=30)


def _push(harness: KVServerHarness, n: int, rid: str, config: TransferConfig = CONFIG):
    """Start a push of ``n`` blocks; (the future of its result, sender pool)."""
    src = make_store(32, seed=7)
    ids = src.reserve(SENDER, n)
    client = GrpcKVClient(config)

    async def go():
        try:
            return await client.push(harness.server.address, src, harness.blocks(rid, ids))
        finally:
            await client.close()
            src.release(SENDER)

    return asyncio.run_coroutine_threadsafe(go(), harness.thread.loop), src


def test_a_push_waits_for_room_then_commits():
    harness = KVServerHarness(CONFIG, num_blocks=8)
    try:
        held = harness.thread.run(_call(lambda: harness.store.reserve(OTHER, 6)))
        future, _ = _push(harness, 3, "waits")
        harness.thread.run(_until(lambda: harness.server.service.num_room_waits == 1))
        assert not future.done()
        assert harness.store.holders() == [OTHER]  # the waiting push holds nothing
        harness.thread.run(_call(lambda: harness.store.release(OTHER, held)))
        harness.thread.run(_call(harness.server.service.notify_room))
        result = future.result(30)
        claimed = harness.server.claim("waits")
        assert claimed is not None and claimed.block_ids == result.remote_block_ids
        harness.store.release(claimed.holder)
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


def test_a_push_bigger_than_the_pool_is_refused_at_once():
    harness = KVServerHarness(CONFIG, num_blocks=4)
    try:
        future, _ = _push(harness, 5, "huge")
        with pytest.raises(TransferError) as err:
            future.result(10)  # not the lease's 30 s
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not isinstance(err.value, PushNoRoom)  # it never could fit: a real failure
        assert "whole pool holds 4" in err.value.message
        assert harness.server.service.num_room_waits == 0
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


def test_a_push_that_waits_past_its_bound_is_no_room_not_a_failed_transfer():
    short = TransferConfig(security=CONFIG.security, lease_s=0.5)
    harness = KVServerHarness(short, num_blocks=8)
    try:
        held = harness.thread.run(_call(lambda: harness.store.reserve(OTHER, 6)))
        future, _ = _push(harness, 3, "full", short)
        with pytest.raises(TransferError) as err:
            future.result(20)
        assert isinstance(err.value, PushNoRoom), err.value
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert is_no_room(err.value)
        assert harness.server.service.num_room_waits == 1
        harness.thread.run(_call(lambda: harness.store.release(OTHER, held)))
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


class _RayTaskError(Exception):
    """What Ray raises in the caller for a worker call that failed: the cause rides along."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_no_room_survives_a_worker_call_and_other_transfer_errors_do_not_pass_for_it():
    import pickle

    no_room = pickle.loads(pickle.dumps(PushNoRoom(grpc.StatusCode.RESOURCE_EXHAUSTED, "x")))
    assert is_no_room(no_room) and is_no_room(_RayTaskError(no_room))
    too_big = TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED, "frame over the limit")
    assert not is_no_room(too_big) and not is_no_room(_RayTaskError(too_big))


async def _call(fn):
    return fn()


async def _until(ready, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not ready():
            await asyncio.sleep(0.01)
