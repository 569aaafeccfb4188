"""Which tier holds a block, in the block index, and what routing makes of
it: a host-tier block counts host_block_weight of a device block."""

from __future__ import annotations

import pytest

from block_index import InMemoryIndex, KVEvent, TierCounts, TieredIndex
from router.prefix_routing import PrefixRouter
from tests.unit.test_prefix_routing import (
    BS,
    HASHES,
    PROMPT,
    ROOT,
    First,
    Worker,
    kv_worker,
    router,
)

pytestmark = pytest.mark.unit


def test_the_index_tracks_the_host_tier():
    index = InMemoryIndex()
    assert isinstance(index, TieredIndex)
    index.apply(KVEvent("a", tuple(HASHES[:6])))
    assert index.lookup_tiers(HASHES) == {"a": TierCounts(6, 0)}
    index.apply(KVEvent("a", tuple(HASHES[3:6]), host=tuple(HASHES[3:6])))  # spilled
    assert index.lookup(HASHES) == {"a": 6}
    assert index.lookup_tiers(HASHES) == {"a": TierCounts(6, 3, 3)}
    assert index.lookup_tiers(HASHES)["a"].device == 3
    index.apply(KVEvent("a", (HASHES[3],)))  # restored to the device
    assert index.lookup_tiers(HASHES) == {"a": TierCounts(6, 2, 4)}
    index.apply(KVEvent("a", (), (HASHES[5],)))  # gone from both tiers
    assert index.lookup_tiers(HASHES) == {"a": TierCounts(5, 1, 4)}
    assert index.host_blocks("a") == {HASHES[4]}
    index.apply(KVEvent("a", tuple(HASHES[:2]), reset=True))
    assert index.lookup_tiers(HASHES) == {"a": TierCounts(2, 0)}
    index.apply(KVEvent("b", tuple(HASHES[:4]), host=tuple(HASHES[:4])))
    index.drop_worker("b")
    assert index.host_blocks("b") == set() and index.lookup_tiers(HASHES) == {"a": TierCounts(2)}


def _plan(index: InMemoryIndex, weight: float) -> str:
    workers = [Worker("dev"), Worker("host")]
    r = PrefixRouter(index, BS, ROOT, First(), local_prefill_tokens=0, pull_min_blocks=0,
                     host_block_weight=weight)  # fmt: skip
    plan = r.plan(PROMPT, [], workers, colocated=True)
    assert plan is not None
    return plan.decode.name


@pytest.mark.parametrize(
    ("host_blocks", "weight", "winner"),
    [
        (4, 0.75, "dev"),  # as many blocks, the device's are worth more
        (6, 0.75, "host"),  # 6 * 0.75 = 4.5 > 4
        (5, 0.75, "dev"),  # 5 * 0.75 = 3.75 < 4
        (5, 1.0, "host"),  # a weight of 1 counts tiers alike
    ],
)
def test_routing_weighs_a_host_hit_below_a_device_hit(host_blocks, weight, winner):
    index = InMemoryIndex()
    index.apply(KVEvent("dev", tuple(HASHES[:4])))
    held = tuple(HASHES[:host_blocks])
    index.apply(KVEvent("host", held, host=held))
    assert _plan(index, weight) == winner


def test_a_pull_takes_only_the_sources_leading_device_blocks():
    """The source's pool pins only device blocks (pool_store.pin_hashes stops
    at the first it lacks): host-tier blocks are no pull source."""
    index = InMemoryIndex()
    index.apply(KVEvent("d0", tuple(HASHES[:8])))
    index.apply(KVEvent("d0", tuple(HASHES[3:8]), host=tuple(HASHES[3:8])))  # spilled
    index.apply(KVEvent("d1", tuple(HASHES[:5])))
    r, _ = router(index, pull_min_blocks=2)
    prefill = [kv_worker("p0")]
    decode = [kv_worker("d0", in_flight=5), kv_worker("d1", in_flight=5)]
    plan = r.plan(PROMPT, prefill, decode, colocated=False)
    assert plan is not None and plan.prefill is not None and plan.prefill.name == "p0"
    assert plan.pull_from is not None and plan.pull_from.name == "d1"
    assert plan.pull_hashes == HASHES[:5]  # not d0's 8, 5 of them in its host tier


def test_available_tokens_counts_only_routable_workers():
    index = InMemoryIndex()
    index.apply(KVEvent("gone", tuple(HASHES[:9])))  # indexed, out of routing
    index.apply(KVEvent("d0", tuple(HASHES[:2])))
    r, _ = router(index)
    plan = r.plan(PROMPT, [], [Worker("d0")], colocated=True)
    assert plan is not None and plan.available_tokens == 2 * BS
