"""InMemoryIndex: leading-prefix lookup semantics, events, and a property test."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from block_index import (
    BlockIndex,
    EventPublisher,
    InMemoryIndex,
    InProcessPublisher,
    KVEvent,
)
from engine.hashing import hash_blocks, root_hash

pytestmark = pytest.mark.unit


def chain(n: int, seed: int = 0) -> list[bytes]:
    """A real hash chain of n blocks (block size 4)."""
    root = root_hash("test-model", 4)
    return hash_blocks([seed * 1000 + i for i in range(4 * n)], 4, root)


def test_protocols():
    index = InMemoryIndex()
    assert isinstance(index, BlockIndex)
    assert isinstance(InProcessPublisher(index), EventPublisher)
    assert index.healthy


def test_empty_index_and_empty_query():
    index = InMemoryIndex()
    assert index.lookup(chain(5)) == {}
    index.apply(KVEvent("w0", stored=tuple(chain(3))))
    assert index.lookup([]) == {}


def test_leading_prefix_counted():
    h = chain(8)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h[:5])))
    assert index.lookup(h) == {"w0": 5}
    assert index.lookup(h[:3]) == {"w0": 3}
    assert index.lookup(h[:5]) == {"w0": 5}


def test_first_hash_missing_means_nothing():
    h = chain(8)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h[1:])))
    assert index.lookup(h) == {}


def test_gap_stops_the_count():
    h = chain(10)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h[:3] + h[4:])))  # block 3 missing
    assert index.lookup(h) == {"w0": 3}


def test_several_workers():
    h = chain(10)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h[:2])))
    index.apply(KVEvent("w1", stored=tuple(h[:7])))
    index.apply(KVEvent("w2", stored=tuple(h)))
    index.apply(KVEvent("w3", stored=tuple(h[1:])))  # no first block: absent
    index.apply(KVEvent("w4", stored=tuple(chain(10, seed=1))))  # another chain
    assert index.lookup(h) == {"w0": 2, "w1": 7, "w2": 10}
    assert index.workers() == {"w0", "w1", "w2", "w3", "w4"}


def test_several_workers_with_gaps():
    h = chain(6)
    index = InMemoryIndex()
    index.apply(KVEvent("a", stored=(h[0], h[1], h[3], h[4], h[5])))
    index.apply(KVEvent("b", stored=(h[0], h[1], h[2], h[4])))
    assert index.lookup(h) == {"a": 2, "b": 3}


def test_removal():
    h = chain(6)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h)))
    index.apply(KVEvent("w0", removed=(h[4],)))
    assert index.lookup(h) == {"w0": 4}
    index.apply(KVEvent("w0", removed=(h[0],)))
    assert index.lookup(h) == {}
    index.apply(KVEvent("w0", removed=(h[0], b"x" * 16)))  # removing again: harmless
    assert index.num_blocks("w0") == 4


def test_removed_then_stored_in_one_event():
    h = chain(3)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h)))
    index.apply(KVEvent("w0", stored=(h[2],), removed=(h[2],)))
    assert index.lookup(h) == {"w0": 3}  # removed applies first, then stored


def test_reset_drops_everything_first():
    h, g = chain(5), chain(5, seed=1)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h)))
    index.apply(KVEvent("w1", stored=tuple(h[:2])))
    index.apply(KVEvent("w0", stored=tuple(g[:3]), reset=True))
    assert index.lookup(h) == {"w1": 2}
    assert index.lookup(g) == {"w0": 3}
    index.apply(KVEvent("w0", reset=True))
    assert index.lookup(g) == {}
    assert "w0" in index.workers()  # known, holds nothing
    assert index.num_blocks("w0") == 0


def test_drop_worker():
    h = chain(4)
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=tuple(h)))
    index.apply(KVEvent("w1", stored=tuple(h[:1])))
    index.drop_worker("w0")
    index.drop_worker("never-seen")
    assert index.lookup(h) == {"w1": 1}
    assert index.workers() == {"w1"}
    assert index.num_blocks() == 1


def test_replace_all():
    h = chain(4)
    index = InMemoryIndex()
    index.apply(KVEvent("old", stored=tuple(h)))
    index.replace_all({"a": h[:2], "b": []})
    assert index.workers() == {"a", "b"}
    assert index.lookup(h) == {"a": 2}


def test_in_process_publisher_feeds_the_index():
    h = chain(3)
    index = InMemoryIndex()
    pub = InProcessPublisher(index)
    pub.publish(KVEvent("w0", stored=tuple(h)))
    assert index.lookup(h) == {"w0": 3}
    pub.close()


def test_lookup_never_raises():
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=(b"a" * 16,)))
    assert index.lookup([b"a" * 16, [1, 2]]) in ({}, {"w0": 1})  # unhashable: {} at worst


def test_concurrent_apply_and_lookup():
    chains = [chain(32, seed=s) for s in range(8)]
    index = InMemoryIndex()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(worker: str) -> None:
        try:
            i = 0
            while not stop.is_set():
                c = chains[i % len(chains)]
                index.apply(KVEvent(worker, stored=tuple(c)))
                index.apply(KVEvent(worker, removed=tuple(c[16:])))
                i += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(2000):
            for c in chains:
                for count in index.lookup(c).values():
                    assert 1 <= count <= 32
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors


def test_many_worker_combinations_match_naive():
    """More distinct holder sets than the interning table keeps before pruning."""
    rng = random.Random(0)
    workers = [f"w{i}" for i in range(12)]
    hashes = [rng.randbytes(16) for _ in range(3000)]
    index, ref = InMemoryIndex(), NaiveIndex()
    for step in range(6):
        for w in workers:
            ev = KVEvent(
                w,
                stored=tuple(h for h in hashes if rng.random() < 0.5),
                removed=tuple(h for h in hashes if rng.random() < 0.2),
                reset=step == 3 and w == "w0",
            )
            index.apply(ev)
            ref.apply(ev)
        if step == 4:
            index.drop_worker("w5")
            ref.drop_worker("w5")
    for i in range(0, len(hashes), 7):
        q = hashes[i : i + 10]
        assert index.lookup(q) == ref.lookup(q)
    for w, held in ref.held.items():
        assert index.blocks(w) == held


# -- property test against a naive reference ----------------------------------


class NaiveIndex:
    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {}

    def apply(self, ev: KVEvent) -> None:
        s = self.held.setdefault(ev.worker, set())
        if ev.reset:
            s.clear()
        s.difference_update(ev.removed)
        s.update(ev.stored)

    def drop_worker(self, worker: str) -> None:
        self.held.pop(worker, None)

    def lookup(self, hashes: list[bytes]) -> dict[str, int]:
        out = {}
        for w, s in self.held.items():
            n = 0
            while n < len(hashes) and hashes[n] in s:
                n += 1
            if n:
                out[w] = n
        return out


HASHES = [bytes([i]) * 16 for i in range(12)]
hash_st = st.sampled_from(HASHES)
worker_st = st.sampled_from(["w0", "w1", "w2", "w3"])
event_st = st.builds(
    KVEvent,
    worker=worker_st,
    stored=st.lists(hash_st, max_size=8).map(tuple),
    removed=st.lists(hash_st, max_size=4).map(tuple),
    reset=st.sampled_from([False, False, False, True]),
)
op_st = st.one_of(
    event_st.map(lambda e: ("apply", e)),
    worker_st.map(lambda w: ("drop", w)),
    st.lists(hash_st, max_size=10).map(lambda q: ("lookup", q)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=40))
def test_matches_naive_reference(ops):
    index, ref = InMemoryIndex(), NaiveIndex()
    for kind, arg in ops:
        if kind == "apply":
            index.apply(arg)
            ref.apply(arg)
        elif kind == "drop":
            index.drop_worker(arg)
            ref.drop_worker(arg)
        else:
            assert index.lookup(arg) == ref.lookup(arg)
        assert index.workers() == set(ref.held)
    for q in (HASHES, HASHES[:3], HASHES[::-1]):
        assert index.lookup(q) == ref.lookup(q)
    for w, s in ref.held.items():
        assert index.blocks(w) == s
