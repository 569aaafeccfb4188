"""The router's fit check agrees with the decode worker's scheduler when the
worker holds the prompt's prefix in its cache, idle: the reported room counts
those blocks as free already, so the router must not take them off again."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.hashing import root_hash
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from router.admission import blocks_for, fits_room, longest_blocks

pytestmark = pytest.mark.unit

BS = 2
ROOT = root_hash("test-model", BS)
PROMPT = [1, 2, 3, 4, 5, 6]  # 3 full blocks, 2 reusable (one token is recomputed)


def _step(sched: Scheduler) -> list[Sequence]:
    """One engine step: compute, cache full blocks, append a token where due."""
    batch = sched.schedule()
    for item in batch:
        seq = item.seq
        seq.num_computed += item.num_tokens
        full = seq.num_computed // BS
        hashes = seq.full_block_hashes(full, BS, ROOT)
        for j in range(full):
            sched.pool.cache(seq.block_table[j], hashes[j], seq.token_ids(j * BS, (j + 1) * BS))
        if seq.num_computed == seq.num_tokens:
            seq.output_token_ids.append(100 + len(seq.output_token_ids))
    return [item.seq for item in batch]


@pytest.mark.parametrize("max_tokens", [3, 5, 6, 7, 9])
def test_router_fits_exactly_when_the_worker_admits_with_an_idle_cached_prefix(max_tokens):
    pool = BlockPool(10, BS)
    sched = Scheduler(pool, ROOT, 64, 8, enable_prefix_caching=True)
    sched.enable_growth_reserve(max_model_len=0, external=lambda: 0)
    first = Sequence("first", list(PROMPT), SamplingParams(max_tokens=1), 0)
    sched.add(first)
    _step(sched)
    sched.running.remove(first)
    sched.free_blocks(first)  # its prompt's blocks stay cached, idle
    other = Sequence("other", [50, 51], SamplingParams(max_tokens=8), 1)
    sched.add(other)
    _step(sched)  # runs, holding 1 of its 5 blocks at its longest
    reported = sched.room()  # what the worker reports on its output stream
    assert reported == 10 - 1 - 4
    cached = 2  # the index's count of the prompt's blocks on that worker

    seq = Sequence("new", list(PROMPT), SamplingParams(max_tokens=max_tokens), 2)
    sched.add(seq)
    admitted = seq in _step(sched)
    assert seq.num_cached_tokens == (cached * BS if admitted else 0)
    longest = longest_blocks(len(PROMPT), max_tokens, 0, BS)
    assert longest == blocks_for(len(PROMPT) + max_tokens - 1, BS)
    fits, promised = fits_room(longest, pool.num_blocks, reported)
    assert fits == admitted
    assert promised == longest
    assert fits_room(longest, None, None) == (True, 0)  # no report yet: no promise
