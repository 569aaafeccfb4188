"""engine.scheduler on its own: no model, a tiny pool of 4-token blocks.

A step is driven the way LLMEngine.step drives it: schedule, then count the
scheduled tokens as computed, cache the full blocks (prefix caching), and
give a sequence that reached its last token one sampled token. The tests
check only the scheduler's public behaviour: who is scheduled with how many
tokens, the queues, who is preempted, block tables and ``pool.num_free``.
"""

from __future__ import annotations

import pytest

from engine.hashing import root_hash
from engine.sampling import SamplingParams

# The pool class the scheduler is built on, wherever it is defined.
from engine.scheduler import BlockPool, Scheduler
from engine.sequence import SeqStatus, Sequence

pytestmark = pytest.mark.unit

BS = 4
ROOT = root_hash("scheduler-test", BS)
SAMPLED = 7  # the token every "sampled" step appends


def make(
    num_blocks: int = 16,
    budget: int = 64,
    max_seqs: int = 8,
    prefix_caching: bool = False,
) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, BS), ROOT, budget, max_seqs, prefix_caching)


_arrivals = iter(range(1 << 30))


def seq(rid: str, n: int, first: int = 100) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), SamplingParams(), next(_arrivals))


def step(s: Scheduler, cache: bool | None = None) -> list[tuple[str, int]]:
    """One engine step without a model: (request id, tokens) as scheduled.
    Full blocks are cached in the pool where prefix caching is on (or ``cache``)."""
    batch = s.schedule()
    for item in batch:
        q = item.seq
        q.num_computed += item.num_tokens
        if s.enable_prefix_caching if cache is None else cache:  # LLMEngine._cache_full_blocks
            full = q.num_computed // BS
            hashes = q.full_block_hashes(full, BS, ROOT)
            for j in range(len(q.block_hashes), full):
                q.block_hashes.append(hashes[j])
                s.pool.cache(q.block_table[j], hashes[j], q.token_ids(j * BS, (j + 1) * BS))
        if q.num_computed == q.num_tokens:
            q.output_token_ids.append(SAMPLED)
    return [(item.seq.request_id, item.num_tokens) for item in batch]


def blocks_for(tokens: int) -> int:
    return -(-tokens // BS)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget_then_decodes():
    s = make(num_blocks=8, budget=4)
    a = seq("a", 10)
    s.add(a)
    assert a.status is SeqStatus.WAITING
    assert step(s) == [("a", 4)]
    assert a.status is SeqStatus.RUNNING and s.running == [a] and not s.waiting
    assert len(a.block_table) == 1 and s.pool.num_free == 7
    assert step(s) == [("a", 4)]
    assert len(a.block_table) == 2 and a.output_token_ids == []
    assert step(s) == [("a", 2)]  # the rest of the prompt, then a sampled token
    assert a.output_token_ids == [SAMPLED] and a.num_tokens == 11
    assert len(a.block_table) == 3 and s.pool.num_free == 5
    assert step(s) == [("a", 1)]  # a decode: the token sampled last step
    assert step(s) == [("a", 1)]  # position 11 fills block 2; no new block yet
    assert len(a.block_table) == 3 and s.pool.num_free == 5
    assert step(s) == [("a", 1)]  # position 12 opens block 3
    assert len(a.block_table) == 4 and s.pool.num_free == 4


def test_running_sequences_come_first_and_a_new_prompt_gets_the_rest_of_the_budget():
    s = make(budget=8)
    a, b = seq("a", 6), seq("b", 10, first=500)
    s.add(a)
    assert step(s) == [("a", 6)]
    s.add(b)
    assert step(s) == [("a", 1), ("b", 7)]  # continuous batching: a decodes, b starts
    assert step(s) == [("a", 1), ("b", 3)]
    assert step(s) == [("a", 1), ("b", 1)]
    assert s.running == [a, b]
    assert set(a.block_table).isdisjoint(b.block_table)
    assert len(a.block_table) == blocks_for(a.num_computed)
    assert len(b.block_table) == blocks_for(b.num_computed)


def test_the_budget_serves_the_oldest_running_sequences_first():
    s = make(budget=2)
    a, b, c = seq("a", 1), seq("b", 1, first=200), seq("c", 1, first=300)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 1), ("b", 1)]
    assert list(s.waiting) == [c] and s.running == [a, b]
    assert step(s) == [("a", 1), ("b", 1)]  # c waits: the running use the budget
    assert list(s.waiting) == [c] and s.num_preemptions == 0
    s.remove(a)
    assert step(s) == [("b", 1), ("c", 1)]


def test_max_num_seqs_caps_the_running_set_and_admission_is_first_come():
    s = make(max_seqs=2)
    a, b, c = seq("a", 3), seq("b", 3, first=200), seq("c", 3, first=300)
    for q in (a, b, c):
        s.add(q)
    assert step(s) == [("a", 3), ("b", 3)]
    assert list(s.waiting) == [c] and c.block_table == []
    assert step(s) == [("a", 1), ("b", 1)]
    s.remove(b)
    assert step(s) == [("a", 1), ("c", 3)]
    assert s.running == [a, c]


def test_a_prompt_that_cannot_get_its_blocks_holds_back_those_behind_it():
    s = make(num_blocks=4)
    a = seq("a", 8)
    s.add(a)
    assert step(s) == [("a", 8)]
    b, c = seq("b", 12, first=200), seq("c", 3, first=300)  # b needs 3 blocks, c 1
    s.add(b)
    s.add(c)
    assert step(s) == [("a", 1)]  # a opens its third block: one is left, b needs three
    assert list(s.waiting) == [b, c]
    assert b.block_table == [] and b.num_computed == 0 and b.status is SeqStatus.WAITING
    assert s.pool.num_free == 1  # b's failed admission holds nothing


def test_the_youngest_running_sequence_is_preempted_for_an_older_ones_block():
    s = make(num_blocks=4)
    a, b = seq("a", 8), seq("b", 7, first=200)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 8), ("b", 7)]
    assert s.pool.num_free == 0
    c = seq("c", 1, first=300)
    s.add(c)
    assert step(s) == [("a", 1)]  # a's 9th token needs a block: b gives its two back
    assert s.num_preemptions == 1
    assert s.running == [a] and list(s.waiting) == [b, c]  # b goes first again
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_computed == 0
    assert b.output_token_ids == [SAMPLED]  # what it generated is kept, to recompute
    assert len(a.block_table) == 3 and s.pool.num_free == 1
    s.remove(a)
    assert s.pool.num_free == 4
    assert step(s) == [("b", 8), ("c", 1)]  # b recomputed from scratch: prompt and output
    assert len(b.block_table) == 2 and s.pool.num_free == 1


def test_a_step_that_preempts_admits_nobody():
    s = make(num_blocks=4, budget=5)
    a, b = seq("a", 8), seq("b", 8, first=200)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 5)]
    assert step(s) == [("a", 3), ("b", 2)]
    # a's 9th token takes the last block; b's next chunk finds none: b is
    # preempted. Its first chunk would fit now, but it waits for the next step.
    assert step(s) == [("a", 1)]
    assert s.num_preemptions == 1 and list(s.waiting) == [b] and s.pool.num_free == 1
    assert step(s) == [("a", 1), ("b", 4)]


def test_a_sequence_alone_without_a_block_preempts_itself():
    s = make(num_blocks=2)
    a = seq("a", 8)
    s.add(a)
    assert step(s) == [("a", 8)]
    assert step(s) == []  # its 9th token has no block and nobody younger to evict
    assert s.running == [] and list(s.waiting) == [a]
    assert s.num_preemptions == 1 and s.pool.num_free == 2


def test_speculated_tokens_are_scheduled_and_get_blocks():
    s = make(num_blocks=8, budget=16)
    a = seq("a", 4)
    s.add(a)
    assert step(s) == [("a", 4)]
    a.spec_token_ids = [1, 2, 3]
    batch = s.schedule()
    assert [(i.seq.request_id, i.num_tokens) for i in batch] == [("a", 4)]  # 1 + 3 proposed
    assert len(a.block_table) == 2  # positions 4..7


def test_admission_reuses_the_cached_prefix_and_always_computes_the_last_token():
    s = make(num_blocks=8, prefix_caching=True)
    a = seq("a", 9)
    s.add(a)
    assert step(s) == [("a", 9)]
    shared = list(a.block_table[:2])  # the two full blocks, now cached
    s.remove(a)
    assert s.pool.num_free == 8  # cached blocks count as free

    b = Sequence("b", [*range(100, 108), 1, 2], SamplingParams(), 1)
    s.add(b)
    assert step(s) == [("b", 2)]  # 8 of 10 tokens were cached
    assert b.block_table[:2] == shared and b.num_cached_tokens == 8
    s.remove(b)

    c = Sequence("c", list(range(100, 108)), SamplingParams(), 2)  # exactly the cached 8
    s.add(c)
    assert step(s) == [("c", 4)]  # the last block is recomputed: it gives the logits
    assert c.block_table[0] == shared[0] and c.num_cached_tokens == 4
    s.remove(c)

    d = Sequence("d", [*range(100, 104), 0, 0, 0, 0, 9], SamplingParams(), 3)
    s.add(d)
    assert step(s) == [("d", 5)]  # the second block differs: only the first is reused
    assert d.num_cached_tokens == 4
    s.remove(d)
    assert s.pool.num_free == 8


def test_without_prefix_caching_nothing_is_reused():
    s = make(num_blocks=8)
    a = seq("a", 9)
    s.add(a)
    step(s, cache=True)  # the pool holds a's full blocks (as after a KV transfer)
    s.remove(a)
    b = seq("b", 9)
    s.add(b)
    assert step(s) == [("b", 9)] and b.num_cached_tokens == 0


def test_an_admission_that_does_not_fit_gives_back_its_cached_prefix():
    s = make(num_blocks=4, prefix_caching=True)
    a = seq("a", 9)
    s.add(a)
    assert step(s) == [("a", 9)]
    s.remove(a)  # its two full blocks stay cached
    c = seq("c", 7, first=500)
    s.add(c)
    assert step(s) == [("c", 7)]  # the two uncached blocks: the cached two are left
    assert s.pool.num_free == 2
    b = seq("b", 16)  # a's 8 cached tokens, then 8 more: 2 more blocks than are left
    s.add(b)
    assert step(s) == [("c", 1)]
    assert list(s.waiting) == [b] and b.block_table == [] and b.num_computed == 0
    assert s.pool.num_free == 2
    s.remove(c)
    assert step(s) == [("b", 8)] and b.num_cached_tokens == 8  # the prefix survived


def test_a_preempted_sequence_resumes_from_its_cached_blocks():
    s = make(num_blocks=4, prefix_caching=True)
    a, b = seq("a", 8), seq("b", 7, first=200)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 8), ("b", 7)]
    assert step(s) == [("a", 1)]  # b preempted; its one full block stays cached
    s.remove(a)
    assert step(s) == [("b", 4)]  # tokens 4..7 again, block 0 from the cache
    assert b.num_computed == 8 and len(b.block_table) == 2


def test_removing_waiting_and_running_sequences_gives_every_block_back():
    s = make(num_blocks=6, budget=8)
    a, b = seq("a", 12), seq("b", 5, first=200)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 8)]  # b waits for budget
    assert s.pool.num_free == 4
    s.remove(b)
    s.remove(a)
    assert not s.has_work() and s.pool.num_free == 6
    assert a.block_table == [] and a.num_computed == 0
