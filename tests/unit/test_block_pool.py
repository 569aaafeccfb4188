"""Block pool on tiny specs: exact ids, reference counts, eviction order."""

from __future__ import annotations

import pytest

from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import BlockPool

pytestmark = pytest.mark.unit

ROOT = root_hash("test-model", 2)


def _hashes(tokens):
    return hash_blocks(tokens, 2, ROOT)


def test_allocate_gives_lowest_ids_first_and_refuses_when_short():
    pool = BlockPool(4, block_size=2)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 1
    assert pool.allocate(2) is None
    assert pool.num_free == 1  # a refused allocation changes nothing
    assert pool.ref_counts == [1, 1, 1, 0]


def test_free_returns_blocks_and_double_free_is_an_error():
    pool = BlockPool(3, block_size=2)
    blocks = pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 3
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([blocks[0]])


def test_cached_blocks_are_shared_with_ref_counts():
    pool = BlockPool(4, block_size=2)
    tokens = [1, 2, 3, 4]
    hashes = _hashes(tokens)
    blocks = pool.allocate(2)
    for b, h, i in zip(blocks, hashes, (0, 2), strict=True):
        assert pool.cache(b, h, tokens[i : i + 2])
    assert pool.match_prefix(hashes, [[1, 2], [3, 4]]) == blocks
    assert pool.ref_counts[:2] == [2, 2]
    pool.free(blocks)
    pool.free(blocks)
    assert pool.ref_counts[:2] == [0, 0]
    assert pool.num_free == 4 and pool.num_cached == 2  # cached blocks stay reusable


def test_token_mismatch_on_hash_hit_is_a_miss():
    pool = BlockPool(2, block_size=2)
    h = _hashes([1, 2])
    (b,) = pool.allocate(1)
    pool.cache(b, h[0], [1, 2])
    assert pool.match_prefix(h, [[9, 9]]) == []  # as if the hash collided
    assert pool.ref_counts[b] == 1


def test_free_blocks_are_used_before_cached_ones_then_lru_eviction():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(2)  # blocks 0, 1
    b = pool.allocate(1)  # block 2
    ha, hb = _hashes([1, 2, 3, 4]), _hashes([7, 8])
    pool.cache(a[0], ha[0], [1, 2])
    pool.cache(a[1], ha[1], [3, 4])
    pool.cache(b[0], hb[0], [7, 8])
    pool.free(a)  # tail first: block 1 then block 0 become evictable
    pool.free(b)  # then block 2
    assert pool.num_free == 4
    assert pool.drain_events() == ([ha[0], ha[1], hb[0]], [])
    assert pool.allocate(1) == [3]  # the never-cached block goes first
    assert pool.allocate(1) == [1]  # then the least recently freed cached block
    assert pool.drain_events() == ([], [ha[1]])
    assert pool.allocate(2) == [0, 2]
    assert pool.num_cached == 0


def test_match_takes_blocks_out_of_eviction_and_refreshes_lru():
    pool = BlockPool(3, block_size=2)
    x, y = pool.allocate(1), pool.allocate(1)
    hx, hy = _hashes([1, 1]), _hashes([2, 2])
    pool.cache(x[0], hx[0], [1, 1])
    pool.cache(y[0], hy[0], [2, 2])
    pool.free(x)
    pool.free(y)
    assert pool.match_prefix(hx, [[1, 1]]) == x  # x is in use again
    pool.free(x)  # and now the most recently used
    assert pool.allocate(2) == [2, y[0]]  # free block first, then LRU: y before x


def test_events_are_the_net_change_since_the_last_drain():
    pool = BlockPool(1, block_size=2)
    h1, h2 = _hashes([1, 1]), _hashes([2, 2])
    (b,) = pool.allocate(1)
    pool.cache(b, h1[0], [1, 1])
    pool.free([b])
    assert pool.allocate(1) == [b]  # evicts h1
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
