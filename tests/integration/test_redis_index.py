"""The Redis block index against a real redis-server that the tests stop and restart."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from block_index import KVEvent, RedisEventPublisher, RedisIndex, redis_prefix
from block_index.redis_index import pack_hashes
from engine.hashing import hash_blocks, root_hash
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

PREFIX = redis_prefix("test", "model-a")
WAIT_S = 20.0
FAST = {"backoff_max_s": 0.3, "socket_timeout_s": 1.0}


def chain(n: int, seed: int = 0) -> list[bytes]:
    root = root_hash("model-a", 4)
    return hash_blocks([seed * 10_000 + i for i in range(4 * n)], 4, root)


def wait_for(pred: Callable[[], bool], timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class Env:
    """Publishers and routers on the test's own redis-server, closed at the end."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.made: list = []

    def pub(self, worker: str, prefix: str = PREFIX, **kw) -> RedisEventPublisher:
        opts = {"heartbeat_s": 0.2, "ttl_s": 1.0, **FAST, **kw}
        pub = RedisEventPublisher(self.server.url, prefix, worker, **opts)
        self.made.append(pub)
        return pub

    def index(self, prefix: str = PREFIX, **kw) -> RedisIndex:
        opts = {"refresh_s": 0.2, **FAST, **kw}
        index = RedisIndex(self.server.url, prefix, **opts)
        self.made.append(index)
        assert index.wait_ready(WAIT_S)
        return index

    def raw(self) -> redis.Redis:
        return redis.Redis.from_url(self.server.url)

    def close(self) -> None:
        for obj in reversed(self.made):
            obj.close()


@pytest.fixture
def env(redis_server: RedisServer) -> Iterator[Env]:  # noqa: F811
    e = Env(redis_server)
    yield e
    e.close()


def test_events_from_two_workers_reach_the_index(env):
    index = env.index()
    assert index.healthy
    p0, p1 = env.pub("prefill-0"), env.pub("prefill-1")
    h = chain(8)
    p0.publish(KVEvent("prefill-0", stored=tuple(h[:6])))
    p1.publish(KVEvent("prefill-1", stored=tuple(h[:3])))
    assert wait_for(lambda: index.lookup(h) == {"prefill-0": 6, "prefill-1": 3})
    p0.publish(KVEvent("prefill-0", removed=(h[2],)))
    assert wait_for(lambda: index.lookup(h) == {"prefill-0": 2, "prefill-1": 3})
    p1.publish(KVEvent("prefill-1", stored=tuple(h), reset=True))
    assert wait_for(lambda: index.lookup(h) == {"prefill-0": 2, "prefill-1": 8})
    assert index.workers() == {"prefill-0", "prefill-1"}


def test_publisher_snapshot_set_matches(env):
    pub = env.pub("w0")
    assert pub.flush()  # the start-up reset went out
    h = chain(5)
    pub.publish(KVEvent("w0", stored=tuple(h)))
    pub.publish(KVEvent("w0", removed=(h[0],)))
    assert pub.flush()
    r = env.raw()
    assert r.smembers(f"{PREFIX}:blocks:w0") == set(h[1:])
    assert r.exists(f"{PREFIX}:worker:w0")
    entries = r.xrange(f"{PREFIX}:events")
    # the start-up reset, then one entry per event
    assert [e[1][b"reset"] for e in entries] == [b"1", b"0", b"0"]
    assert entries[1][1][b"stored"] == pack_hashes(h)
    assert entries[2][1][b"removed"] == h[0]


def test_two_routers_agree(env):
    a, b = env.index(), env.index()
    pubs = {w: env.pub(w) for w in ("w0", "w1", "w2")}
    chains = [chain(16, seed=s) for s in range(4)]
    for i, (w, pub) in enumerate(pubs.items()):
        for c in chains[i:]:
            pub.publish(KVEvent(w, stored=tuple(c[: 4 + 4 * i])))
    pubs["w1"].publish(KVEvent("w1", removed=(chains[2][3],)))
    for pub in pubs.values():
        assert pub.flush()
    expected = [
        {"w0": 4},
        {"w0": 4, "w1": 8},
        {"w0": 4, "w1": 3, "w2": 12},
        {"w0": 4, "w1": 8, "w2": 12},
    ]
    assert wait_for(lambda: [a.lookup(c) for c in chains] == expected)
    assert wait_for(lambda: [b.lookup(c) for c in chains] == expected)
    assert a.workers() == b.workers() == {"w0", "w1", "w2"}


def test_late_router_rebuilds_from_snapshot(env):
    p0, p1 = env.pub("w0"), env.pub("w1")
    h = chain(10)
    p0.publish(KVEvent("w0", stored=tuple(h)))
    p1.publish(KVEvent("w1", stored=tuple(h[:4])))
    p0.publish(KVEvent("w0", removed=(h[7],)))
    assert p0.flush() and p1.flush()
    env.raw().xtrim(f"{PREFIX}:events", maxlen=0)  # only the sets are left
    late = env.index()
    assert late.lookup(h) == {"w0": 7, "w1": 4}
    assert late.stats["events"] == 0


def test_trimmed_stream_is_detected_and_rebuilt(env):
    index = env.index()
    pub = env.pub("w0")
    h = chain(4)
    pub.publish(KVEvent("w0", stored=tuple(h[:2])))
    assert wait_for(lambda: index.lookup(h) == {"w0": 2})
    rebuilds = index.stats["rebuilds"]
    # an event the router can never read: added and trimmed away atomically
    r = env.raw()
    with r.pipeline(transaction=True) as pipe:
        pipe.sadd(f"{PREFIX}:blocks:w0", *h[2:])
        pipe.xadd(f"{PREFIX}:events", {"worker": "w0", "stored": pack_hashes(h[2:])})
        pipe.xtrim(f"{PREFIX}:events", maxlen=0)
        pipe.execute()
    assert wait_for(lambda: index.lookup(h) == {"w0": 4})
    assert index.stats["rebuilds"] > rebuilds


def test_dead_worker_disappears_after_ttl(env):
    index = env.index()
    alive, dead = env.pub("alive"), env.pub("dead")
    h = chain(6)
    alive.publish(KVEvent("alive", stored=tuple(h[:2])))
    dead.publish(KVEvent("dead", stored=tuple(h)))
    assert wait_for(lambda: index.lookup(h) == {"alive": 2, "dead": 6})
    dead.abandon()  # no clean leave: its set stays, its heartbeat expires
    assert wait_for(lambda: index.lookup(h) == {"alive": 2})
    assert index.workers() == {"alive"}
    assert env.raw().exists(f"{PREFIX}:blocks:dead")
    assert env.index().lookup(h) == {"alive": 2}  # a new router ignores it too


def test_clean_leave(env):
    index = env.index()
    pub = env.pub("w0")
    h = chain(3)
    pub.publish(KVEvent("w0", stored=tuple(h)))
    assert wait_for(lambda: index.lookup(h) == {"w0": 3})
    pub.close()
    assert wait_for(lambda: index.lookup(h) == {} and index.workers() == set())
    r = env.raw()
    assert not r.exists(f"{PREFIX}:blocks:w0", f"{PREFIX}:worker:w0")
    pub.publish(KVEvent("w0", stored=tuple(h)))  # after close: ignored, no raise


def test_expired_heartbeat_resyncs(env):
    """Routers drop a worker whose key vanished; the worker notices and comes back."""
    index = env.index()
    pub = env.pub("w0")
    h = chain(5)
    pub.publish(KVEvent("w0", stored=tuple(h)))
    assert wait_for(lambda: index.lookup(h) == {"w0": 5})
    resyncs = pub.stats["resyncs"]
    env.raw().delete(f"{PREFIX}:worker:w0")
    assert wait_for(lambda: pub.stats["resyncs"] > resyncs)
    assert wait_for(lambda: index.lookup(h) == {"w0": 5})


def test_deployments_do_not_see_each_other(env):
    other = redis_prefix("other", "model-a")
    ia, ib = env.index(), env.index(prefix=other)
    pa, pb = env.pub("w0"), env.pub("w0", prefix=other)
    h = chain(6)
    pa.publish(KVEvent("w0", stored=tuple(h[:2])))
    pb.publish(KVEvent("w0", stored=tuple(h[:5])))
    assert wait_for(lambda: ia.lookup(h) == {"w0": 2} and ib.lookup(h) == {"w0": 5})
    pa.close()
    assert wait_for(lambda: ia.lookup(h) == {})
    assert ib.lookup(h) == {"w0": 5}


def test_bad_events_are_dropped_not_raised(env):
    index = env.index()
    pub = env.pub("w0")
    pub.publish(KVEvent("w0", stored=(b"short",)))
    pub.publish(KVEvent("w1", stored=tuple(chain(2))))  # not this publisher's worker
    pub.publish(None)  # type: ignore[arg-type]
    h = chain(2)
    pub.publish(KVEvent("w0", stored=tuple(h)))
    assert wait_for(lambda: index.lookup(h) == {"w0": 2})
    assert index.workers() == {"w0"}


def test_redis_outage_and_empty_restart(env):
    """Redis stops mid-publishing, then comes back empty: everything heals by itself."""
    r1, r2 = env.index(), env.index()
    cached: set[bytes] = set()  # w1's engine state, read by its snapshot()
    lock = threading.Lock()

    def snapshot() -> list[bytes]:
        with lock:
            return list(cached)

    p0 = env.pub("w0")  # mirrors its own events
    p1 = env.pub("w1", snapshot=snapshot)
    chains = [chain(8, seed=s) for s in range(40)]
    stop = threading.Event()
    errors: list[BaseException] = []
    progress = [0]

    def engine_loop() -> None:
        try:
            i = 0
            while not stop.is_set():
                c = chains[i % len(chains)]
                p0.publish(KVEvent("w0", stored=tuple(c)))
                with lock:
                    cached.update(c[:4])
                    p1.publish(KVEvent("w1", stored=tuple(c[:4])))
                    if i % 3 == 0:
                        cached.discard(c[3])
                        p1.publish(KVEvent("w1", removed=(c[3],)))
                i += 1
                progress[0] = i
                time.sleep(0.005)
        except BaseException as exc:
            errors.append(exc)

    def expected(c: list[bytes]) -> dict[str, int]:
        with lock:
            n1 = next((k for k, x in enumerate(c) if x not in cached), len(c))
        return {"w0": 8, **({"w1": n1} if n1 else {})}

    def all_right(index: RedisIndex) -> bool:
        return index.healthy and all(index.lookup(c) == expected(c) for c in chains)

    engine = threading.Thread(target=engine_loop)
    engine.start()
    try:
        assert wait_for(lambda: progress[0] > len(chains))
        # w0 holds every chain whole from the first round on
        assert wait_for(lambda: all(r.lookup(c).get("w0") == 8 for r in (r1, r2) for c in chains))

        env.server.stop()
        assert wait_for(lambda: not r1.healthy and not r2.healthy)
        assert r1.lookup(chains[0]) == {} and r2.lookup(chains[0]) == {}
        before = progress[0]
        assert wait_for(lambda: progress[0] > before + 20)  # publishing went on, no raise
        assert engine.is_alive() and not errors

        env.server.restart()  # empty: no sets, no heartbeats, no stream
        assert wait_for(lambda: r1.healthy and r2.healthy)
    finally:
        stop.set()
        engine.join()
    assert not errors
    assert wait_for(lambda: all_right(r1) and all_right(r2))
    assert r1.workers() == r2.workers() == {"w0", "w1"}
    assert p0.stats["resyncs"] >= 2 and p1.stats["resyncs"] >= 2


def test_router_and_worker_started_while_redis_down(env):
    env.server.stop()
    index = RedisIndex(env.server.url, PREFIX, refresh_s=0.2, **FAST)
    env.made.append(index)
    pub = env.pub("w0")
    h = chain(3)
    pub.publish(KVEvent("w0", stored=tuple(h)))
    assert not index.wait_ready(0.5)
    assert not index.healthy
    assert index.lookup(h) == {}
    env.server.start()
    assert wait_for(lambda: index.lookup(h) == {"w0": 3})


def test_a_redis_with_a_password_serves_those_who_give_it_and_no_one_else():
    with RedisServer(password="the redis password").start() as locked:
        env = Env(locked)
        try:
            stranger = RedisIndex(locked.url, PREFIX, **FAST)
            env.made.append(stranger)
            assert not stranger.wait_ready(2)  # NOAUTH: never healthy, never a hit
            index = env.index(password="the redis password")
            pub = env.pub("prefill-0", password="the redis password")
            h = chain(4)
            pub.publish(KVEvent("prefill-0", stored=tuple(h)))
            assert wait_for(lambda: index.lookup(h) == {"prefill-0": 4})
            assert stranger.lookup(h) == {}
        finally:
            env.close()
