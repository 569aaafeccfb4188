"""Reconciling the block index with the workers' blocks (block_index/reconcile.py,
router/index_reconcile.py) and the index-fidelity metrics (router/index_fidelity.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from block_index import InMemoryIndex, KVEvent, reconcile
from router.backend import GenerateResult
from router.index_fidelity import HitMetrics, ReconcileCollector, hit_outcome
from router.index_reconcile import IndexReconciler

pytestmark = pytest.mark.unit


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _index() -> InMemoryIndex:
    index = InMemoryIndex()
    index.apply(KVEvent("w0", stored=(h(1), h(2), h(3))))
    index.apply(KVEvent("w1", stored=(h(1), h(4))))
    return index


def _lister(held: dict[str, set[bytes]]):
    async def list_blocks(worker: str) -> set[bytes]:
        if worker not in held:
            raise TimeoutError(f"{worker} did not answer")
        return held[worker]

    return list_blocks


def test_stale_entries_are_found_and_removed():
    index = _index()
    held = {"w0": {h(1), h(3), h(9)}, "w1": {h(1), h(4)}}  # w0 lost h(2); h(9) not indexed yet
    report = asyncio.run(reconcile(index, ["w0", "w1"], _lister(held)))
    assert report.checked_workers == 2
    assert report.checked_entries == 5
    assert report.stale_entries == 1 and report.stale_by_worker == {"w0": 1}
    assert report.missing_entries == 1
    assert index.blocks("w0") == {h(1), h(3)}
    assert index.blocks("w1") == {h(1), h(4)}
    assert index.lookup([h(1), h(2)]) == {"w0": 1, "w1": 1}  # nobody holds h(2) now
    again = asyncio.run(reconcile(index, ["w0", "w1"], _lister(held)))
    assert again.stale_entries == 0


def test_a_worker_that_does_not_answer_is_left_as_it_is():
    index = _index()
    report = asyncio.run(reconcile(index, ["w0", "w1"], _lister({"w1": set()})))
    assert report.unreachable == ("w0",)
    assert report.checked_workers == 1 and report.stale_by_worker == {"w1": 2}
    assert index.blocks("w0") == {h(1), h(2), h(3)}
    assert index.blocks("w1") == set()


def test_a_block_cached_during_the_listing_is_not_stale():
    index = _index()

    async def list_blocks(worker: str) -> set[bytes]:
        index.apply(KVEvent(worker, stored=(h(7),)))  # arrives after the snapshot
        return {h(1), h(2), h(3), h(4), h(7)} if worker == "w0" else {h(1), h(4)}

    report = asyncio.run(reconcile(index, ["w0"], list_blocks))
    assert report.stale_entries == 0
    assert h(7) in index.blocks("w0")


def _handle(name: str, hashes: tuple[bytes, ...]):
    async def reply():
        return SimpleNamespace(worker=name, hashes=hashes)

    remote = SimpleNamespace(remote=lambda: reply())
    return SimpleNamespace(name=name, actor=SimpleNamespace(cached_blocks=remote))


def test_the_reconciler_counts_and_exports_what_it_found():
    index = _index()
    workers = [_handle("w0", (h(1),)), _handle("w1", (h(1), h(4)))]
    reconciler = IndexReconciler(lambda: index, lambda: workers)
    registry = CollectorRegistry()
    registry.register(ReconcileCollector(reconciler.stats))
    report = asyncio.run(reconciler.run())
    assert report.stale_entries == 2
    text = generate_latest(registry).decode()
    assert "tandem_index_stale_entries 2.0" in text
    assert 'tandem_index_stale_entries_removed_total{worker="w0"} 2.0' in text
    assert 'tandem_index_reconciles_total{result="ok"} 1.0' in text
    asyncio.run(reconciler.run())
    text = generate_latest(registry).decode()
    assert "tandem_index_stale_entries 0.0" in text  # the last pass found none
    assert 'tandem_index_stale_entries_removed_total{worker="w0"} 2.0' in text
    workers.pop(0)  # w0 leaves (scaled in): its label goes with it
    asyncio.run(reconciler.run())
    text = generate_latest(registry).decode()
    assert 'worker="w0"' not in text
    with pytest.raises(RuntimeError):
        asyncio.run(IndexReconciler(lambda: None, lambda: workers).run())


@pytest.mark.parametrize(
    ("predicted", "realized", "outcome"),
    [(0, 0, "none"), (32, 32, "as_predicted"), (64, 32, "shortfall"), (0, 16, "surplus")],
)
def test_hit_outcomes(predicted, realized, outcome):
    assert hit_outcome(predicted, realized) == outcome


def _result(predicted: int, realized: int, available: int = 0) -> GenerateResult:
    return GenerateResult(
        "length", 100, realized, 4, 0.1, 0.01, "p", "d",
        predicted_cached_tokens=predicted, available_cached_tokens=available,
    )  # fmt: skip


def test_hit_metrics():
    registry = CollectorRegistry()
    hits = HitMetrics(registry)
    for r in (_result(0, 0), _result(64, 64), _result(64, 16), _result(16, 48, available=80)):
        hits.observe(r)
    text = generate_latest(registry).decode()
    assert "tandem_prefix_predicted_hit_tokens_sum 144.0" in text
    assert "tandem_prefix_realized_hit_tokens_sum 128.0" in text
    assert "tandem_prefix_hit_shortfall_tokens_sum 48.0" in text
    assert "tandem_prefix_hit_shortfall_tokens_count 1.0" in text
    assert "tandem_prefix_routing_loss_tokens_sum 64.0" in text
    for outcome in ("none", "as_predicted", "shortfall", "surplus"):
        assert f'tandem_prefix_hit_requests_total{{outcome="{outcome}"}} 1.0' in text
