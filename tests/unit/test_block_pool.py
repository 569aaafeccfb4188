"""Block pool on tiny specs: exact ids, holders and their references,
eviction order."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, Holder, HolderError
from engine.hashing import hash_blocks, root_hash

pytestmark = pytest.mark.unit

ROOT = root_hash("test-model", 2)
A, B, C = Holder("request", "a"), Holder("request", "b"), Holder("request", "c")
PIN = Holder("lease", "pin-a")  # a transfer holding a cached prefix
LEASE = Holder("lease", "recv:r#0")


def _hashes(tokens):
    return hash_blocks(tokens, 2, ROOT)


def _refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def _cache_each(pool: BlockPool, blocks: list[int], first_token: int) -> list:
    """Cache each block under a one-block prefix of its own: [t, t], [t+1, t+1], ..."""
    hashes = []
    for i, block in enumerate(blocks):
        tokens = [first_token + i] * 2
        (h,) = _hashes(tokens)
        assert pool.cache(block, h, tokens)
        hashes.append(h)
    return hashes


def test_allocate_gives_lowest_ids_first_and_refuses_when_short():
    pool = BlockPool(4, block_size=2)
    assert pool.allocate(A, 3) == [0, 1, 2]
    assert pool.num_free == 1
    assert pool.allocate(B, 2) is None
    assert pool.num_free == 1  # a refused allocation changes nothing
    assert pool.holders() == [A] and pool.held_by(A) == [0, 1, 2]
    assert _refs(pool) == [1, 1, 1, 0]
    assert pool.allocate(B, 0) == [] and pool.holders() == [A]  # nothing held: no holder
    pool.verify()


def test_release_returns_blocks_and_a_second_release_is_an_error():
    pool = BlockPool(3, block_size=2)
    blocks = pool.allocate(A, 2)
    assert pool.release(A) == blocks
    assert pool.num_free == 3 and pool.holders() == [] and pool.num_holders == 0
    with pytest.raises(HolderError, match="request:a holds no blocks"):
        pool.release(A)
    with pytest.raises(HolderError, match="does not hold block 0"):
        pool.release(A, [blocks[0]])
    assert pool.release(A, []) == []  # an explicit empty list is a no-op
    assert pool.num_free == 3 and _refs(pool) == [0, 0, 0]
    pool.verify()


def test_an_unknown_holder_can_release_nothing():
    pool = BlockPool(2, block_size=2)
    pool.allocate(A, 1)
    with pytest.raises(HolderError, match="request:b holds no blocks"):
        pool.release(B)
    with pytest.raises(HolderError, match="request:b does not hold block 0"):
        pool.release(B, [0])  # A's block: B cannot drop A's reference
    assert pool.held_by(A) == [0] and _refs(pool) == [1, 0]


def test_cached_blocks_are_shared_between_holders():
    pool = BlockPool(4, block_size=2)
    tokens = [1, 2, 3, 4]
    hashes = _hashes(tokens)
    blocks = pool.allocate(A, 2)
    for b, h, i in zip(blocks, hashes, (0, 2), strict=True):
        assert pool.cache(b, h, tokens[i : i + 2])
    assert pool.match_prefix(B, hashes, [[1, 2], [3, 4]]) == blocks
    assert _refs(pool)[:2] == [2, 2]
    assert pool.holders() == [A, B] and pool.held_by(B) == blocks
    pool.release(A)
    pool.release(B)
    assert _refs(pool)[:2] == [0, 0] and pool.holders() == []
    assert pool.num_free == 4 and pool.num_cached == 2  # cached blocks stay reusable


def test_token_mismatch_on_hash_hit_is_a_miss():
    pool = BlockPool(2, block_size=2)
    h = _hashes([1, 2])
    (b,) = pool.allocate(A, 1)
    pool.cache(b, h[0], [1, 2])
    assert pool.match_prefix(B, h, [[9, 9]]) == []  # as if the hash collided
    assert pool.ref_count(b) == 1 and pool.holders() == [A]


def test_free_blocks_are_used_before_cached_ones_then_lru_eviction():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(A, 2)  # blocks 0, 1
    b = pool.allocate(B, 1)  # block 2
    ha, hb = _hashes([1, 2, 3, 4]), _hashes([7, 8])
    pool.cache(a[0], ha[0], [1, 2])
    pool.cache(a[1], ha[1], [3, 4])
    pool.cache(b[0], hb[0], [7, 8])
    pool.release(A)  # tail first: block 1 then block 0 become evictable
    pool.release(B)  # then block 2
    assert pool.num_free == 4
    assert pool.drain_events() == ([ha[0], ha[1], hb[0]], [])
    assert pool.allocate(C, 1) == [3]  # the never-cached block goes first
    assert pool.allocate(C, 1) == [1]  # then the least recently freed cached block
    assert pool.drain_events() == ([], [ha[1]])
    assert pool.allocate(C, 2) == [0, 2]
    assert pool.num_cached == 0 and pool.held_by(C) == [3, 1, 0, 2]


def test_match_takes_blocks_out_of_eviction_and_refreshes_lru():
    pool = BlockPool(3, block_size=2)
    x, y = pool.allocate(A, 1), pool.allocate(B, 1)
    hx, hy = _hashes([1, 1]), _hashes([2, 2])
    pool.cache(x[0], hx[0], [1, 1])
    pool.cache(y[0], hy[0], [2, 2])
    pool.release(A)
    pool.release(B)
    assert pool.match_prefix(C, hx, [[1, 1]]) == x  # x is in use again
    pool.release(C)  # and now the most recently used
    assert pool.allocate(A, 2) == [2, y[0]]  # free block first, then LRU: y before x


def test_events_are_the_net_change_since_the_last_drain():
    pool = BlockPool(1, block_size=2)
    h1, h2 = _hashes([1, 1]), _hashes([2, 2])
    (b,) = pool.allocate(A, 1)
    pool.cache(b, h1[0], [1, 1])
    pool.release(A)
    assert pool.allocate(B, 1) == [b]  # evicts h1
    pool.cache(b, h2[0], [2, 2])
    assert pool.drain_events() == ([h2[0]], [h1[0]])  # h1 stored then evicted: net removed
    assert pool.cached_hashes() == [h2[0]]
    assert pool.drain_events() == ([], [])


def test_hashes_are_chained_and_stable():
    a = hash_blocks([1, 2, 3, 4, 5], 2, ROOT)
    assert len(a) == 2  # the partial block gets no hash
    assert hash_blocks([9, 2, 3, 4], 2, ROOT)[1] != a[1]  # a parent change changes the child
    assert root_hash("other", 2) != ROOT and root_hash("test-model", 4) != ROOT
    # Pinned value: the same in every process and on every machine.
    assert a[0].hex() == "79f92ceea28fb5319565787793918180"


# ---- holders -------------------------------------------------------------------


def test_a_holder_keeps_its_blocks_in_order_with_multiplicity():
    pool = BlockPool(4, block_size=2)
    assert pool.allocate(A, 2) == [0, 1]
    assert pool.allocate(B, 1) == [2]
    pool.acquire(B, [0])
    pool.acquire(A, [0])  # a second reference of the same holder
    assert pool.held_by(A) == [0, 1, 0] and pool.held_by(B) == [2, 0]
    assert _refs(pool) == [3, 1, 1, 0]
    assert pool.release(A, [0]) == [0]  # one reference: the last one taken
    assert pool.held_by(A) == [0, 1] and _refs(pool) == [2, 1, 1, 0]
    assert pool.release(A) == [0, 1]
    assert pool.holders() == [B] and _refs(pool) == [1, 0, 1, 0]
    assert pool.num_free == 2
    pool.verify()


def test_releasing_a_holder_goes_tail_first_for_lru():
    pool = BlockPool(3, block_size=2)
    blocks = pool.allocate(A, 3)
    hashes = _cache_each(pool, blocks, 1)
    pool.drain_events()
    assert pool.release(A) == [0, 1, 2]  # in the holder's order; dropped 2, 1, 0
    # The tail went first, so it is evicted first; the head last.
    assert [pool.allocate(B, 1) for _ in range(3)] == [[2], [1], [0]]
    assert pool.drain_events() == ([], hashes[::-1])


def test_releasing_some_blocks_keeps_the_rest():
    pool = BlockPool(4, block_size=2)
    pool.allocate(A, 4)
    assert pool.release(A, [2, 3]) == [2, 3]  # a speculative tail dropped
    assert pool.held_by(A) == [0, 1] and pool.num_free == 2
    assert pool.allocate(B, 1) == [2]  # released 3 then 2: 2 is reused first


def test_a_pin_keeps_a_cached_block_from_eviction_until_released():
    pool = BlockPool(3, block_size=2)
    blocks = pool.allocate(A, 3)
    h0, h1, h2 = _cache_each(pool, blocks, 1)
    pool.release(A)  # all cached, LRU first: 2, 1, 0
    pool.drain_events()
    pool.acquire(PIN, [2])  # pinned: out of eviction
    assert pool.num_free == 2 and pool.holders() == [PIN] and pool.ref_count(2) == 1
    assert pool.allocate(B, 1) == [1]  # the next LRU block, not the pinned one
    assert pool.release(PIN) == [2]  # cached again, now the most recently used
    assert pool.holders() == [B] and pool.num_free == 2
    assert pool.allocate(C, 1) == [0]
    assert pool.allocate(C, 1) == [2]
    assert pool.drain_events() == ([], [h1, h0, h2])


def test_a_pin_on_a_block_in_use_outlives_its_request():
    pool = BlockPool(2, block_size=2)
    (block,) = pool.allocate(A, 1)
    (h,) = _cache_each(pool, [block], 5)
    pool.acquire(PIN, [block])
    assert pool.ref_count(block) == 2
    pool.release(A)
    assert pool.num_free == 1 and pool.holders() == [PIN]
    assert pool.allocate(B, 1) == [1]  # the pinned block is not allocatable
    pool.release(PIN)
    assert pool.match_prefix(C, [h], [[5, 5]]) == [block]  # still cached


def test_acquiring_a_free_block_is_an_error_and_changes_nothing():
    pool = BlockPool(3, block_size=2)
    pool.allocate(A, 1)
    with pytest.raises(HolderError, match="block 2 is neither in use nor cached"):
        pool.acquire(PIN, [0, 2])
    assert pool.holders() == [A] and _refs(pool) == [1, 0, 0]


def test_releasing_a_block_not_held_changes_nothing():
    pool = BlockPool(3, block_size=2)
    pool.allocate(A, 2)
    with pytest.raises(HolderError, match="request:a does not hold block 2"):
        pool.release(A, [0, 2])
    with pytest.raises(HolderError, match="does not hold block 1"):
        pool.release(A, [1, 1])  # held once, released twice
    assert pool.held_by(A) == [0, 1] and _refs(pool) == [1, 1, 0] and pool.num_free == 1


def test_a_lease_handed_to_a_request_keeps_its_references():
    pool = BlockPool(4, block_size=2)
    assert pool.allocate(LEASE, 2) == [0, 1]  # a transfer received two blocks
    _cache_each(pool, [0, 1], 1)
    assert pool.transfer(LEASE, A) == [0, 1]
    assert pool.holders() == [A] and pool.held_by(A) == [0, 1]
    assert _refs(pool) == [1, 1, 0, 0]  # never dropped to 0: never evictable
    assert pool.allocate(B, 2) == [2, 3]
    assert pool.allocate(C, 1) is None
    pool.verify()


def test_a_transfer_of_some_blocks_appends_them_in_the_order_given():
    pool = BlockPool(4, block_size=2)
    pool.allocate(PIN, 1)  # block 0, a pinned prefix
    pool.allocate(LEASE, 2)  # blocks 1, 2, the rest of the request
    assert pool.transfer(PIN, A, [0]) == [0]
    assert pool.transfer(LEASE, A, [2, 1]) == [2, 1]
    assert pool.held_by(A) == [0, 2, 1] and pool.holders() == [A]
    pool.release(A)  # tail first: 1, 2, 0
    assert pool.allocate(B, 3) == [0, 2, 1]


def test_transfer_misuse_is_an_error_and_changes_nothing():
    pool = BlockPool(3, block_size=2)
    pool.allocate(LEASE, 2)
    with pytest.raises(HolderError, match="does not hold block 2"):
        pool.transfer(LEASE, A, [0, 2])
    with pytest.raises(HolderError, match="to itself"):
        pool.transfer(LEASE, LEASE)
    with pytest.raises(HolderError, match="request:b holds no blocks"):
        pool.transfer(B, A)
    assert pool.transfer(B, A, []) == []
    assert pool.holders() == [LEASE] and pool.held_by(LEASE) == [0, 1]
    assert _refs(pool) == [1, 1, 0]


def test_holder_kinds_are_checked():
    assert str(Holder("lease", "r1")) == "lease:r1"
    assert Holder("lease", "pin-a") == PIN and hash(Holder("lease", "pin-a")) == hash(PIN)
    assert Holder("lease", "a") != Holder("request", "a") and PIN != ("lease", "pin-a")
    with pytest.raises(ValueError, match="holder kind"):
        Holder("bogus", "x")  # type: ignore[arg-type]
