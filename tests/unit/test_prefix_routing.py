"""router.prefix_routing.PrefixRouter.plan: which prefill and decode worker a
request goes to, given what the block index says each worker holds, the
load, local_prefill_tokens, pull_min_blocks and colocated mode.

Workers are stand-ins with the attributes plan reads (name, info,
in_flight); the fallback policy takes the first candidate and records the
candidates it was offered, so ties are visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from block_index import InMemoryIndex, KVEvent
from engine.hashing import hash_blocks, root_hash
from protocol.workers import WorkerInfo
from router.prefix_routing import PrefixRouter

pytestmark = pytest.mark.unit

BS = 4
ROOT = root_hash("routing-test", BS)
PROMPT = list(range(1000, 1040))  # 10 full blocks
HASHES = hash_blocks(PROMPT, BS, ROOT)


def info(name: str, kv_address: str | None = None) -> WorkerInfo:
    return WorkerInfo(name, 4096, 1000, "fp", "1", "/model", kv_address=kv_address)


@dataclass(eq=False)
class Worker:
    name: str
    info: WorkerInfo | None = None
    in_flight: int = 0

    def __post_init__(self) -> None:
        self.info = self.info or info(self.name)


def kv_worker(name: str, in_flight: int = 0) -> Worker:
    """A worker that serves KV pulls (its start() reported a KV address)."""
    return Worker(name, info(name, f"{name}:kv"), in_flight)


class First:
    """A fallback policy: the first candidate; remembers every offer."""

    def __init__(self) -> None:
        self.offers: list[list[str]] = []

    def pick(self, workers: Sequence[Worker]) -> Worker:
        self.offers.append([w.name for w in workers])
        return workers[0]


def router(index: InMemoryIndex, **kwargs) -> tuple[PrefixRouter, First]:
    fallback = First()
    kwargs.setdefault("local_prefill_tokens", 0)
    kwargs.setdefault("pull_min_blocks", 0)
    return PrefixRouter(index, BS, ROOT, fallback, **kwargs), fallback


def index_with(**held: int) -> InMemoryIndex:
    """worker name -> how many leading blocks of PROMPT it holds."""
    index = InMemoryIndex()
    for worker, n in held.items():
        index.apply(KVEvent(worker, stored=tuple(HASHES[:n])))
    return index


def names(plan) -> tuple[str | None, str]:
    return (plan.prefill.name if plan.prefill else None, plan.decode.name)


P0, P1 = "p0", "p1"
D0, D1, D2 = "d0", "d1", "d2"


def pools(**in_flight: int) -> tuple[list[Worker], list[Worker]]:
    prefill = [kv_worker(n, in_flight.get(n, 0)) for n in (P0, P1)]
    decode = [kv_worker(n, in_flight.get(n, 0)) for n in (D0, D1, D2)]
    return prefill, decode


def test_with_nothing_cached_the_fallback_picks_from_each_pool():
    r, fallback = router(index_with())
    prefill, decode = pools()
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert names(plan) == (P0, D0)
    assert fallback.offers == [[D0, D1, D2], [P0, P1]]
    assert plan.hashes == HASHES and plan.decode_cached_blocks == 0
    assert plan.pull_from is None and plan.pull_hashes == []


def test_only_full_blocks_are_hashed():
    r, _ = router(index_with())
    prefill, decode = pools()
    plan = r.plan([*PROMPT, 1, 2, 3], prefill, decode, colocated=False)
    assert plan.hashes == HASHES


def test_the_decode_and_prefill_workers_holding_most_of_the_prefix_win():
    r, fallback = router(index_with(d1=3, d2=5, p1=4))
    prefill, decode = pools()
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert names(plan) == (P1, D2)
    assert plan.decode_cached_blocks == 5
    assert fallback.offers == [[D2], [P1]]


def test_load_costs_load_weight_blocks_per_request_in_flight():
    prefill, decode = pools(d1=1)
    index = index_with(d1=3)
    r, _ = router(index)  # load_weight_blocks=4: 3 - 4 < 0
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert plan.decode.name == D0 and plan.decode_cached_blocks == 0
    r, _ = router(index, load_weight_blocks=2.0)  # 3 - 2 > 0
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert plan.decode.name == D1 and plan.decode_cached_blocks == 3


def test_ties_go_to_the_fallback_with_only_the_tied_workers():
    r, fallback = router(index_with(d1=4, d2=4))
    prefill, decode = pools(d0=0)
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert fallback.offers[0] == [D1, D2]
    assert plan.decode.name == D1
    # Equal scores from different mixes of cache and load tie too: 5 - 4 * 1 == 1 - 0.
    r, fallback = router(index_with(d0=1, d1=5))
    prefill, decode = pools(d1=1)
    r.plan(PROMPT, prefill, decode, colocated=False)
    assert fallback.offers[0] == [D0, D1]


def test_colocated_always_prefills_on_the_decode_worker():
    r, fallback = router(index_with(d1=2, p0=9))
    prefill, decode = pools()
    plan = r.plan(PROMPT, prefill, decode, colocated=True)
    assert names(plan) == (None, D1) and plan.decode_cached_blocks == 2
    assert fallback.offers == [[D1]]  # the prefill pool is not consulted
    assert plan.pull_from is None


@pytest.mark.parametrize(
    ("held", "local_prefill_tokens", "local"),
    [
        (8, 8, True),  # 40 - 8 * 4 = 8 tokens left: at the limit
        (8, 7, False),  # one token over
        (9, 4, True),
        (8, 0, False),  # 0 turns local prefill off
        (0, 1000, False),  # nothing cached on the decode worker: never local
    ],
)
def test_a_short_uncached_rest_is_prefilled_on_the_decode_worker(held, local_prefill_tokens, local):
    index = index_with(d0=held) if held else index_with()
    r, _ = router(index, local_prefill_tokens=local_prefill_tokens)
    prefill, decode = pools()
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert plan.decode.name == D0 and plan.decode_cached_blocks == held
    assert (plan.prefill is None) == local
    if not local:
        assert plan.prefill.name == P0


def test_the_prefix_is_pulled_from_the_worker_holding_most_of_it():
    # d1 holds 6 blocks but is too busy to decode (6 - 4 * 2 < 0); p0 holds 1.
    r, _ = router(index_with(p0=1, d1=6), pull_min_blocks=2)
    prefill, decode = pools(d1=2)
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert names(plan) == (P0, D0)
    assert plan.pull_from is not None and plan.pull_from.name == D1
    assert plan.pull_hashes == HASHES[1:6]  # what p0 lacks of d1's prefix


@pytest.mark.parametrize(
    ("pull_min_blocks", "pulls"),
    [(5, True), (6, False), (0, False)],  # d1 has 5 blocks more than p0; 0 turns pulls off
)
def test_a_pull_needs_pull_min_blocks_more_than_the_prefill_worker_has(pull_min_blocks, pulls):
    r, _ = router(index_with(p0=1, d1=6), pull_min_blocks=pull_min_blocks)
    prefill, decode = pools(d1=2)
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert (plan.pull_from is not None) == pulls
    assert plan.pull_hashes == (HASHES[1:6] if pulls else [])


def test_only_workers_serving_kv_are_pulled_from():
    r, _ = router(index_with(d1=6, d2=3), pull_min_blocks=2)
    prefill = [kv_worker(P0)]
    decode = [Worker(D0), Worker(D1, in_flight=2), kv_worker(D2, in_flight=1)]
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert names(plan) == (P0, D0)
    assert plan.pull_from is not None and plan.pull_from.name == D2  # d1 has no "kv"
    assert plan.pull_hashes == HASHES[:3]


class _Unhealthy(InMemoryIndex):
    @property
    def healthy(self) -> bool:
        return False


def test_a_disabled_router_or_an_unhealthy_index_routes_by_the_fallback_alone():
    prefill, decode = pools()
    r, fallback = router(index_with(d2=5, p1=5), enabled=False, pull_min_blocks=2)
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert names(plan) == (P0, D0) and plan.hashes == [] and plan.decode_cached_blocks == 0
    assert plan.pull_from is None
    assert fallback.offers == [[D0, D1, D2], [P0, P1]]

    unhealthy = _Unhealthy()
    unhealthy.apply(KVEvent(D2, stored=tuple(HASHES)))
    r, _ = router(unhealthy, pull_min_blocks=2)
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert names(plan) == (P0, D0) and plan.hashes == []


def test_the_cache_salt_keys_the_index_lookup():
    """Blocks cached under one salt count only for requests of that salt."""
    salted = hash_blocks(PROMPT, BS, ROOT, b"tenant-a")
    index = InMemoryIndex()
    index.apply(KVEvent(D2, stored=tuple(salted[:5])))
    index.apply(KVEvent(D1, stored=tuple(HASHES[:3])))
    r, _ = router(index)
    prefill, decode = pools()
    same = r.plan(PROMPT, prefill, decode, colocated=False, cache_salt=b"tenant-a")
    other = r.plan(PROMPT, prefill, decode, colocated=False, cache_salt=b"tenant-b")
    plain = r.plan(PROMPT, prefill, decode, colocated=False)
    assert (same.decode.name, same.decode_cached_blocks, same.hashes) == (D2, 5, salted)
    assert (other.decode.name, other.decode_cached_blocks) == (D0, 0)
    assert (plain.decode.name, plain.decode_cached_blocks, plain.hashes) == (D1, 3, HASHES)


# ---- the predicted hit (index fidelity) ----------------------------------


def test_predicted_hit_is_the_prefilling_workers_blocks():
    r, _ = router(index_with(p0=3, p1=6, d0=2), load_weight_blocks=10.0)
    busy_p1 = Worker(P1, in_flight=1)  # its 6 blocks lose to p0's 3 at this load weight
    plan = r.plan(PROMPT, [Worker(P0), busy_p1], [Worker(D0)], colocated=False)
    assert names(plan) == (P0, D0)
    assert plan.predicted_tokens == 3 * BS
    assert plan.available_tokens == 6 * BS  # what routing left on p1


def test_predicted_hit_counts_what_the_prefill_pulls():
    r, _ = router(index_with(p0=2, d0=7), pull_min_blocks=2)
    plan = r.plan(PROMPT, [kv_worker(P0)], [kv_worker(D0, in_flight=5)], colocated=False)
    assert plan.prefill.name == P0 and plan.pull_from.name == D0
    assert plan.predicted_tokens == 7 * BS == plan.available_tokens


def test_predicted_hit_of_a_local_prefill_keeps_the_last_token_to_compute():
    # All 10 blocks cached on d0: the engine reuses 9 (the last token gives the logits).
    r, _ = router(index_with(d0=10), local_prefill_tokens=64)
    plan = r.plan(PROMPT, [Worker(P0)], [Worker(D0)], colocated=False)
    assert plan.prefill is None
    assert plan.predicted_tokens == 9 * BS == plan.available_tokens
    cold, _ = router(InMemoryIndex())
    assert cold.plan(PROMPT, [Worker(P0)], [Worker(D0)], colocated=False).predicted_tokens == 0
