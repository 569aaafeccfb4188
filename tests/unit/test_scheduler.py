"""The scheduler over a tiny pool: exact block ids for admission, growth,
preemption and prefix reuse; every block is held by its request's holder."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.hashing import root_hash
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit

BS = 2
ROOT = root_hash("test-model", BS)


def _setup(num_blocks: int, caching: bool) -> tuple[BlockPool, Scheduler]:
    pool = BlockPool(num_blocks, BS)
    return pool, Scheduler(pool, ROOT, 64, 8, enable_prefix_caching=caching)


def _seq(rid: str, prompt: list[int], arrival: int) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=8), arrival)


def _step(sched: Scheduler, next_token: dict[str, int]) -> list[ScheduledSeq]:
    """Schedule, then do what the engine does after its forward pass: count the
    tokens computed, cache full blocks, append the next token where due."""
    batch = sched.schedule()
    for item in batch:
        seq = item.seq
        seq.num_computed += item.num_tokens
        full = seq.num_computed // BS
        hashes = seq.full_block_hashes(full, BS, ROOT)
        if sched.enable_prefix_caching:
            for j in range(full):
                sched.pool.cache(seq.block_table[j], hashes[j], seq.token_ids(j * BS, (j + 1) * BS))
        if seq.num_computed == seq.num_tokens:
            seq.output_token_ids.append(next_token[seq.request_id])
            next_token[seq.request_id] += 1
    return batch


def _finish(sched: Scheduler, seq: Sequence) -> None:
    sched.running.remove(seq)
    sched.free_blocks(seq)


def test_preemption_releases_exactly_the_youngest_requests_blocks():
    pool, sched = _setup(4, caching=False)
    a, b = _seq("a", [1, 2, 3], 0), _seq("b", [4, 5, 6], 1)
    sched.add(a)
    sched.add(b)
    tokens = {"a": 10, "b": 20}
    assert _step(sched, tokens) == [ScheduledSeq(a, 3), ScheduledSeq(b, 3)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert pool.holders() == [a.holder, b.holder]
    _step(sched, tokens)  # 4 tokens each: no new block
    assert pool.num_free == 0
    # a needs a third block: b, the youngest, is preempted; its blocks go tail
    # first (3, then 2), so a gets block 2.
    assert _step(sched, tokens) == [ScheduledSeq(a, 1)]
    assert sched.num_preemptions == 1
    assert a.block_table == [0, 1, 2] and pool.held_by(a.holder) == [0, 1, 2]
    assert pool.holders() == [a.holder] and pool.num_free == 1  # block 3
    assert b.block_table == [] and b.num_computed == 0
    assert b.status is SeqStatus.WAITING and sched.waiting[0] is b
    _finish(sched, a)
    assert pool.holders() == [] and pool.num_free == 4
    # b is recomputed from scratch; a released tail first, so its head is reused first.
    assert _step(sched, tokens) == [ScheduledSeq(b, 5)]
    assert b.block_table == [0, 1, 2] and pool.holders() == [b.holder]
    _finish(sched, b)
    assert pool.holders() == [] and pool.num_free == 4
    pool.verify()


def test_a_preempted_request_gets_its_surviving_cached_blocks_back():
    pool, sched = _setup(4, caching=True)
    a, b = _seq("a", [1, 2, 3], 0), _seq("b", [4, 5, 6], 1)
    sched.add(a)
    sched.add(b)
    tokens = {"a": 10, "b": 20}
    _step(sched, tokens)
    _step(sched, tokens)  # every block full and cached: a [1 2][3 10], b [4 5][6 20]
    assert pool.num_cached == 4
    _step(sched, tokens)  # b preempted, tail first: block 3 is the LRU one and is evicted
    assert a.block_table == [0, 1, 3] and pool.holders() == [a.holder]
    assert pool.ref_count(2) == 0 and pool.num_free == 1 and pool.num_cached == 3
    _finish(sched, a)  # block 3 (never cached for a) is free; 1 and 0 join the LRU after 2
    assert pool.holders() == []
    # b: [4 5] is still cached in block 2, [6 20] was evicted; then block 3 (free)
    # and block 1 (the LRU cached one) for the rest.
    assert _step(sched, tokens) == [ScheduledSeq(b, 3)]
    assert b.block_table == [2, 3, 1] and pool.held_by(b.holder) == [2, 3, 1]
    _finish(sched, b)
    assert pool.holders() == [] and pool.num_free == 4


def test_an_admission_that_does_not_fit_releases_its_matched_prefix():
    pool, sched = _setup(2, caching=True)
    a = _seq("a", [1, 2, 3], 0)
    sched.add(a)
    _step(sched, {"a": 10})  # a holds [0, 1]; block 0 is cached as [1 2]
    c = _seq("c", [1, 2, 7, 8, 9], 1)
    sched.add(c)
    assert _step(sched, {"a": 11}) == [ScheduledSeq(a, 1)]  # c matched block 0, then no room
    assert pool.holders() == [a.holder] and pool.ref_count(0) == 1
    assert c.block_table == [] and sched.waiting[0] is c
    sched.remove(c)  # a waiting request with no blocks: nothing to release
    sched.remove(a)
    assert pool.holders() == [] and pool.num_free == 2
    pool.verify()


def test_prefix_hits_count_once_when_the_admission_succeeds():
    pool, sched = _setup(3, caching=True)
    a = _seq("a", [1, 2, 3], 0)
    sched.add(a)
    _step(sched, {"a": 10})  # a holds [0, 1]; block 0 is cached as [1 2]
    assert pool.num_hits == 0
    c = _seq("c", [1, 2, 7, 8, 9], 1)
    sched.add(c)
    for _ in range(3):  # c matches block 0 every step, then finds no room
        _step(sched, {"a": 11})
        assert sched.waiting[0] is c
    assert pool.num_hits == 0  # the tries that failed count nothing
    _finish(sched, a)
    _step(sched, {"c": 20})
    assert c.block_table[0] == 0 and c.num_cached_tokens == BS
    assert pool.num_hits == 1  # counted once, by the admission that kept it
    sched.remove(c)
    pool.verify()


def _finished(seq: Sequence) -> bool:
    return len(seq.output_token_ids) >= seq.params.max_tokens


def test_growth_reserve_admits_only_what_leaves_every_running_sequence_room():
    # 8 blocks of 2 tokens; each request: 3 prompt tokens + 4 outputs, so 3
    # blocks at its longest (the last output is never computed).
    _, sched = _setup(8, caching=False)
    external = [0]
    sched.enable_growth_reserve(max_model_len=0, external=lambda: external[0])
    seqs = [Sequence(r, [1, 2, 3], SamplingParams(max_tokens=4), i) for i, r in enumerate("abc")]
    assert sched.seq_final_blocks(seqs[0]) == 3
    for seq in seqs:
        sched.add(seq)
    tokens = {"a": 10, "b": 20, "c": 30}
    _step(sched, tokens)
    assert sched.running == seqs[:2]  # c would leave a or b short: 2 * 3 + 3 > 8
    assert sched.growth_reserve() == 2  # a and b hold 2 blocks each, need 3
    assert sched.room() == 8 - 4 - 2
    external[0] = 1  # a push in flight promised one more
    assert sched.room() == 1
    while not all(_finished(s) for s in seqs[:2]):
        _step(sched, tokens)
        assert sched.running == seqs[:2]  # c still waits: room 1 < 3
    assert sched.num_preemptions == 0
    for seq in seqs[:2]:
        _finish(sched, seq)
    external[0] = 0
    _step(sched, tokens)
    assert sched.running == [seqs[2]]


def test_without_the_reserve_the_same_load_preempts():
    _, sched = _setup(8, caching=False)
    seqs = [Sequence(r, [1, 2, 3], SamplingParams(max_tokens=4), i) for i, r in enumerate("abc")]
    for seq in seqs:
        sched.add(seq)
    tokens = {"a": 10, "b": 20, "c": 30}
    for _ in range(4):
        _step(sched, tokens)
    assert sched.num_preemptions > 0  # what the reserve above prevents
