"""A push whose blocks do not fit waits for room instead of failing, holding
nothing while it waits; one that could never fit is refused at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.block_pool import Holder
from kv_transfer import GrpcKVClient, TransferConfig, TransferError
from net.security import ClusterSecurity
from tests.kv_harness import KVServerHarness, make_store

pytestmark = pytest.mark.unit

SENDER = Holder("request", "sender")
OTHER = Holder("request", "running")  # what the receiving pool is full of
CONFIG = TransferConfig(security=ClusterSecurity.generate(), lease_s=30)


def _push(harness: KVServerHarness, n: int, rid: str):
    """Start a push of ``n`` blocks; (the future of its result, sender pool)."""
    src = make_store(32, seed=7)
    ids = src.reserve(SENDER, n)
    client = GrpcKVClient(CONFIG)

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
        assert "whole pool holds 4" in err.value.message
        assert harness.server.service.num_room_waits == 0
        assert harness.settle() == ([], harness.initial_free)
    finally:
        harness.close()


async def _call(fn):
    return fn()


async def _until(ready, timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not ready():
            await asyncio.sleep(0.01)
