"""Pool sizes over a run, sampled from the router's Prometheus ``/metrics``.

Each sample reads ``tandem_pool_workers{pool}`` (workers in routing) and,
when the router autoscales, ``tandem_pool_target_workers{pool}`` (what it
aims at). A router without ``tandem_pool_workers`` is read by counting its
workers in ``tandem_worker_kv_blocks_total{worker, role}``. Parsing is
prometheus_client's own text parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.auth import client_headers

log = logging.getLogger(__name__)

WORKERS = "tandem_pool_workers"
TARGET = "tandem_pool_target_workers"
PER_WORKER = "tandem_worker_kv_blocks_total"


@dataclass(frozen=True)
class PoolSample:
    t_s: float  # seconds since the run's start
    pool: str  # prefill, decode or colocated
    workers: int
    target: int | None  # None: the router does not say (no autoscaler)


def parse_pool_sizes(text: str) -> dict[str, tuple[int, int | None]]:
    """Pool -> (workers, target or None) from a ``/metrics`` page."""
    workers: dict[str, int] = {}
    targets: dict[str, int] = {}
    per_role: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == WORKERS:
                workers[s.labels["pool"]] = int(s.value)
            elif s.name == TARGET:
                targets[s.labels["pool"]] = int(s.value)
            elif s.name == PER_WORKER:
                per_role.setdefault(s.labels["role"], set()).add(s.labels["worker"])
    if not workers:
        workers = {role: len(names) for role, names in per_role.items()}
    return {pool: (n, targets.get(pool)) for pool, n in sorted(workers.items())}


class PoolSampler:
    """Polls ``metrics_url`` every ``interval_s`` while a run goes on."""

    def __init__(self, metrics_url: str, interval_s: float = 1.0, timeout_s: float = 5.0) -> None:
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.samples: list[PoolSample] = []
        self.errors = 0
        self.last_error = ""
        self._task: asyncio.Task | None = None

    def start(self, run_start: float) -> None:
        """Begin sampling (inside the run's event loop); times are from ``run_start``
        (``time.perf_counter``)."""
        self._task = asyncio.create_task(self._loop(run_start))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self, run_start: float) -> None:
        async with httpx.AsyncClient(headers=client_headers(), timeout=self.timeout_s) as client:
            while True:
                t = time.perf_counter() - run_start
                try:
                    resp = await client.get(self.metrics_url)
                    resp.raise_for_status()
                    sizes = parse_pool_sizes(resp.text)
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    self.errors += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                else:
                    self.samples += [PoolSample(t, p, n, tg) for p, (n, tg) in sizes.items()]
                await asyncio.sleep(self.interval_s)
