"""Index fidelity metrics: the prefix hit the block index predicted against
the hit the worker realized, per request, and what the last reconcile of the
index with the workers' blocks found (router/index_reconcile.py).

How to read them: docs/prefix-caching.md.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from block_index import ReconcileReport

from .backend import GenerateResult

HIT_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
OUTCOMES = ("none", "as_predicted", "shortfall", "surplus")


def hit_outcome(predicted: int, realized: int) -> str:
    """``none`` (nothing predicted, nothing reused), ``as_predicted``,
    ``shortfall`` (reused less than predicted) or ``surplus`` (more)."""
    if predicted == realized:
        return "none" if predicted == 0 else "as_predicted"
    return "shortfall" if realized < predicted else "surplus"


class HitMetrics:
    """Per-request predicted and realized prefix hits, on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=HIT_TOKEN_BUCKETS, registry=registry)

        self.predicted = tokens(
            "tandem_prefix_predicted_hit_tokens",
            "Prompt tokens the block index predicted the prefilling worker holds, per request",
        )
        self.realized = tokens(
            "tandem_prefix_realized_hit_tokens",
            "Prompt tokens the worker reused from its prefix cache, per request",
        )
        self.shortfall = tokens(
            "tandem_prefix_hit_shortfall_tokens",
            "Predicted minus realized hit tokens, per request that reused less than predicted",
        )
        self.routing_loss = tokens(
            "tandem_prefix_routing_loss_tokens",
            "Hit tokens the best holder had beyond the chosen worker's, per request "
            "routed away from it (load or room)",
        )
        self.outcomes = Counter(
            "tandem_prefix_hit_requests",
            "Finished requests by how their realized prefix hit compared with the prediction",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.outcomes.labels(outcome)

    def observe(self, result: GenerateResult) -> None:
        predicted, realized = result.predicted_cached_tokens, result.cached_tokens
        self.predicted.observe(predicted)
        self.realized.observe(realized)
        outcome = hit_outcome(predicted, realized)
        self.outcomes.labels(outcome).inc()
        if outcome == "shortfall":
            self.shortfall.observe(predicted - realized)
        if result.available_cached_tokens > predicted:
            self.routing_loss.observe(result.available_cached_tokens - predicted)


@dataclass
class ReconcileStats:
    """What the reconciles of this router's index found, for the metrics."""

    passes: int = 0
    failures: int = 0
    stale_removed: int = 0  # since the router started
    last: ReconcileReport | None = None
    last_at: float = 0.0  # time.time() of the last pass
    last_error: str = ""
    by_worker: dict[str, int] = field(default_factory=dict)  # stale removed, of workers in routing

    def record(self, report: ReconcileReport, workers: Collection[str]) -> None:
        """``workers``: those in routing at this pass; a worker that left loses
        its count (and its metric's label: autoscaled names never come back)."""
        self.passes += 1
        self.stale_removed += report.stale_entries
        self.by_worker = {w: n for w, n in self.by_worker.items() if w in workers}
        for w, n in report.stale_by_worker.items():
            self.by_worker[w] = self.by_worker.get(w, 0) + n
        self.last, self.last_at = report, time.time()

    def failed(self, error: str) -> None:
        self.failures += 1
        self.last_error = error


class ReconcileCollector(Collector):
    """Exposes a :class:`ReconcileStats`."""

    def __init__(self, stats: ReconcileStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s, last = self.stats, self.stats.last
        gauges = {
            "stale_entries": (
                "Stale index entries the last reconcile found (and removed)",
                last.stale_entries if last else 0,
            ),
            "checked_entries": (
                "Index entries the last reconcile checked",
                last.checked_entries if last else 0,
            ),
            "missing_entries": (
                "Blocks workers held that the index lacked at the last reconcile",
                last.missing_entries if last else 0,
            ),
            "last_reconcile_timestamp_seconds": (
                "When the last reconcile ran (Unix time)",
                s.last_at,
            ),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"tandem_index_{name}", doc)
            family.add_metric([], value)
            yield family
        removed = CounterMetricFamily(
            "tandem_index_stale_entries_removed",
            "Stale index entries removed by reconciles since the router started, by worker",
            labels=["worker"],
        )
        for w, n in sorted(s.by_worker.items()):
            removed.add_metric([w], n)
        yield removed
        passes = CounterMetricFamily(
            "tandem_index_reconciles", "Reconciles of the block index, by result", labels=["result"]
        )
        passes.add_metric(["ok"], s.passes)
        passes.add_metric(["failed"], s.failures)
        yield passes
