"""Prometheus metrics of one router (served on the HTTP front's ``/metrics``).

Request metrics are recorded by the router as requests run (both fronts,
see lifecycle.py). Worker metrics (KV pool usage, running and waiting
sequences, bytes moved) come from the workers' ``stats`` calls, pulled when
``/metrics`` is scraped. Each router has its own registry (no global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .backend import GenerateResult, WorkerReport
from .backpressure import UnreadTotals
from .index_fidelity import HitMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)


@dataclass(frozen=True)
class TierSample:
    """One KV tier of a worker: its device pool's prefix cache, or its host tier."""

    tier: str  # "device" or "host"
    cached_blocks: int
    hit_blocks: int
    bytes_in: int = 0  # bytes copied into this tier from the other


@dataclass(frozen=True)
class WorkerSample:
    """One worker's numbers, from its ``stats`` call."""

    name: str
    role: str
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    kv_bytes_pushed: int = 0
    kv_bytes_pulled: int = 0
    tiers: tuple[TierSample, ...] = ()

    @classmethod
    def of(cls, report: WorkerReport) -> WorkerSample:
        stats = report.stats
        return cls(
            name=report.name,
            role=report.role,
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_bytes_pushed=stats.kv_bytes_pushed,
            kv_bytes_pulled=stats.kv_bytes_pulled,
            tiers=(
                TierSample("device", stats.kv_cached_blocks, stats.kv_prefix_hit_blocks,
                           stats.kv_tier_bytes_out),
                TierSample("host", stats.kv_tier_blocks, stats.kv_tier_hit_blocks,
                           stats.kv_tier_bytes_in),
            )
            if stats.kv_tier_capacity_blocks
            else (TierSample("device", stats.kv_cached_blocks, stats.kv_prefix_hit_blocks),),
        )  # fmt: skip


class WorkerCollector(Collector):
    """Exposes the latest worker samples (set by ``RouterMetrics.set_workers``)."""

    def __init__(self) -> None:
        self.samples: list[WorkerSample] = []

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "role"]
        gauges = {
            "kv_blocks_used": ("KV blocks in use (not free) on the worker", self._used),
            "kv_blocks_total": ("KV blocks in the worker's pool", lambda s: s.total_blocks),
            "kv_usage_ratio": ("Share of the worker's KV pool in use", self._ratio),
            "running_sequences": ("Sequences the worker is running", lambda s: s.running),
            "waiting_sequences": ("Sequences queued on the worker", lambda s: s.waiting),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"tandem_worker_{name}", doc, labels=labels)
            for s in self.samples:
                family.add_metric([s.name, s.role], value(s))
            yield family
        counters = {
            "kv_pushed_bytes": ("KV bytes the worker pushed", lambda s: s.kv_bytes_pushed),
            "kv_pulled_bytes": ("KV bytes the worker pulled", lambda s: s.kv_bytes_pulled),
        }
        for name, (doc, value) in counters.items():
            family = CounterMetricFamily(f"tandem_worker_{name}", doc, labels=labels)
            for s in self.samples:
                family.add_metric([s.name, s.role], value(s))
            yield family
        yield from self._tiers()
        queued = GaugeMetricFamily("tandem_queue_depth", "Sequences waiting on all workers")
        queued.add_metric([], sum(s.waiting for s in self.samples))
        yield queued
        running = GaugeMetricFamily("tandem_running_sequences", "Sequences running on all workers")
        running.add_metric([], sum(s.running for s in self.samples))
        yield running
        pools = GaugeMetricFamily(
            "tandem_pool_workers", "Workers in routing, by pool (role)", labels=["pool"]
        )
        for role in sorted({s.role for s in self.samples}):
            pools.add_metric([role], sum(1 for s in self.samples if s.role == role))
        yield pools

    def _tiers(self) -> Iterator[Metric]:
        """Per worker and KV tier (device, host): blocks, prefix hits, bytes moved in."""
        labels = ["worker", "role", "tier"]
        blocks = GaugeMetricFamily(
            "tandem_worker_kv_tier_blocks", "Cached KV blocks in the tier", labels=labels
        )
        hits = CounterMetricFamily(
            "tandem_worker_kv_tier_hit_blocks", "Prefix blocks found in the tier", labels=labels
        )
        moved = CounterMetricFamily(
            "tandem_worker_kv_tier_moved_in_bytes",
            "KV bytes copied into the tier from the worker's other tier",
            labels=labels,
        )
        for s in self.samples:
            for t in s.tiers:
                key = [s.name, s.role, t.tier]
                blocks.add_metric(key, t.cached_blocks)
                hits.add_metric(key, t.hit_blocks)
                moved.add_metric(key, t.bytes_in)
        yield from (blocks, hits, moved)

    @staticmethod
    def _used(s: WorkerSample) -> int:
        return s.total_blocks - s.free_blocks

    @staticmethod
    def _ratio(s: WorkerSample) -> float:
        return (s.total_blocks - s.free_blocks) / s.total_blocks if s.total_blocks else 0.0


class UnreadCollector(Collector):
    """Output the router holds for clients that have not read it (router/backpressure.py)."""

    def __init__(self, totals: UnreadTotals) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        t = self.totals
        now = GaugeMetricFamily(
            "tandem_unread_output_bytes", "Output bytes held for clients, not yet accepted"
        )
        now.add_metric([], t.bytes)
        yield now
        peak = GaugeMetricFamily(
            "tandem_unread_output_peak_bytes",
            "Most unread output bytes one request has held since the router started",
        )
        peak.add_metric([], t.peak_bytes)
        yield peak
        ended = CounterMetricFamily(
            "tandem_slow_client_requests",
            "Requests ended because their client read too slowly, by reason",
            labels=["reason"],
        )
        ended.add_metric(["bound"], t.cut)
        ended.add_metric(["timeout"], t.timed_out)
        yield ended


class RouterMetrics:
    def __init__(self) -> None:
        self._token_totals = (0, 0)  # (prompt, cached) tokens, for the hit rate
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_requests",
            "Finished requests by front (grpc, http) and status (gRPC code name)",
            ["protocol", "status"],
            registry=r,
        )
        self.in_flight = Gauge("tandem_requests_in_flight", "Requests in the router", registry=r)
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "Request received to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_inter_token_latency_seconds",
            "Time between two streamed deltas of a request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem_time_per_output_token_seconds",
            "Mean time per output token after the first, one sample per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_e2e_request_latency_seconds",
            "Request received to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "tandem_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Tokens generated for finished requests", registry=r
        )
        self.hit_rate = Gauge(
            "tandem_prefix_cache_hit_rate",
            "Cached prompt tokens / prompt tokens, since the router started",
            registry=r,
        )
        self.hit_rate.set_function(self._hit_rate)
        self.transfer_bytes = Counter(
            "tandem_kv_transfer_bytes", "KV bytes pushed from prefill to decode", registry=r
        )
        self.transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds",
            "Duration of one request's KV push (prefill to decode)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.auth_refused = Counter(
            "tandem_auth_refused", "Calls refused for a missing or invalid API key", registry=r
        )
        self.pool_target = Gauge(
            "tandem_pool_target_workers",
            "Workers the autoscaler wants in each pool (router/autoscaler.py)",
            ["pool"],
            registry=r,
        )
        self.autoscale_latency = Gauge(
            "tandem_autoscaler_latency_seconds",
            "The autoscaler's latency at its quantile: predicted at the current sizes "
            "(corrected) or observed, for ttft and tpot",
            ["kind", "source"],
            registry=r,
        )
        self.autoscale_correction = Gauge(
            "tandem_autoscaler_correction",
            "Observed over predicted latency the autoscaler applies to its model",
            ["kind"],
            registry=r,
        )
        self.autoscale_decisions = Counter(
            "tandem_autoscaler_decisions",
            "Pool size changes the autoscaler made, by pool and direction (up, down)",
            ["pool", "direction"],
            registry=r,
        )
        self.workers = WorkerCollector()
        r.register(self.workers)
        # Called with every finished result and its e2e time (the autoscaler's observer).
        self.result_listeners: list[Callable[[GenerateResult, float], None]] = []
        self.unread = UnreadTotals()
        r.register(UnreadCollector(self.unread))
        self.hits = HitMetrics(r)  # predicted and realized prefix hits (index fidelity)

    def _hit_rate(self) -> float:
        prompt, cached = self._token_totals
        return cached / prompt if prompt else 0.0

    def observe_result(self, result: GenerateResult, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        if result.completion_tokens:
            self.ttft.observe(result.ttft_s)  # the backend's clock: from the request's arrival
        if result.completion_tokens > 1:
            self.tpot.observe(result.mean_tpot_s)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.cached_tokens.inc(result.cached_tokens)
        prompt, cached = self._token_totals
        self._token_totals = (prompt + result.prompt_tokens, cached + result.cached_tokens)
        self.generation_tokens.inc(result.completion_tokens)
        self.hits.observe(result)
        if result.kv_transfer_s is not None:
            self.transfer_seconds.observe(result.kv_transfer_s)
            self.transfer_bytes.inc(result.kv_transfer_bytes)
        for listener in self.result_listeners:
            listener(result, e2e_s)

    def set_workers(self, reports: list[WorkerReport]) -> None:
        self.workers.samples = [WorkerSample.of(r) for r in sorted(reports, key=lambda r: r.name)]

    def render(self) -> bytes:
        return generate_latest(self.registry)
