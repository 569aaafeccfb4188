"""Reconciling the Redis block index with a worker's blocks: the stale entries
leave the reconciling router's view, the worker's set in Redis, and (through
the event stream) every other router's view. Starts its own redis-server."""

from __future__ import annotations

import asyncio

import pytest

from block_index import KVEvent, reconcile
from tests.integration.test_redis_index import PREFIX, Env, chain, wait_for
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def env(redis_server: RedisServer):  # noqa: F811
    e = Env(redis_server)
    yield e
    e.close()


def test_stale_entries_leave_redis_and_every_router(env):
    a, b = env.index(), env.index()
    pub = env.pub("w0")
    h = chain(6)
    # The worker published 6 blocks, then lost the removal of the last two.
    pub.publish(KVEvent("w0", stored=tuple(h)))
    assert pub.flush()
    assert wait_for(lambda: a.lookup(h) == {"w0": 6} and b.lookup(h) == {"w0": 6})

    async def list_blocks(worker: str) -> set[bytes]:
        return set(h[:4])

    report = asyncio.run(reconcile(a, ["w0"], list_blocks))
    assert report.stale_entries == 2 and report.checked_entries == 6
    assert a.lookup(h) == {"w0": 4}  # at once, locally
    assert env.raw().smembers(f"{PREFIX}:blocks:w0") == set(h[:4])
    assert wait_for(lambda: b.lookup(h) == {"w0": 4})  # through the stream
    assert env.index().lookup(h) == {"w0": 4}  # a router starting now reads the sets
    assert asyncio.run(reconcile(a, ["w0"], list_blocks)).stale_entries == 0
