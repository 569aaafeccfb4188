"""A whole tandem deployment (Ray pools + router) inside this process: what
`tandem plan --verify`, the benchmarks (bench/) and the integration tests
start. `tandem serve` does not use it.

The router and its backend run on an event loop in a thread of their own,
so callers stay synchronous and talk to it over gRPC like any client.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Mapping
from typing import Any

from protocol.workers import WorkerStats
from router.config import ServeConfig
from router.ray_backend import RayBackend
from tandem_cli.serve import server_for


class Deployment:
    def __init__(
        self,
        config: ServeConfig,
        actor_classes: Mapping[str, type] | None = None,
        backend_cls: type[RayBackend] = RayBackend,
    ) -> None:
        """``actor_classes``: Ray actor classes to run instead of a pool's own, by
        pool: "prefill" (a PrefillActor subclass) or "decode" (a DecodeActor
        subclass, for colocated workers too); router/pool_manager.py
        ``WorkerPool.actor_cls``. The chaos tests inject transfer faults so.
        ``backend_cls``: a RayBackend subclass (a benchmark's baseline)."""
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.backend = backend_cls(config)
        for pool, cls in (actor_classes or {}).items():
            if pool not in ("prefill", "decode"):
                raise ValueError(f"no {pool!r} pool (prefill, decode)")
            getattr(self.backend, pool).actor_cls = cls
        # Both fronts on 127.0.0.1, free ports; HTTP only when config.server.http_port is set.
        self.server = server_for(config, self.backend, local=True)
        self.run(self.server.start(), timeout=300)
        self.address = self.server.address
        self.http_url = self.server.http.url if self.server.http is not None else None

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def worker_stats(self) -> dict[str, WorkerStats]:
        return {r.name: r.stats for r in self.run(self.backend.worker_reports())}

    def leaked_blocks(self) -> dict[str, int]:
        """Workers with a block holder beyond the engine's own (a request, a
        transfer lease, a pin), a request, or a free block count other than
        their starting one: how many blocks they hold beyond the start."""
        return {
            name: s.initial_free_blocks - s.free_blocks
            for name, s in self.worker_stats().items()
            if not s.idle
        }

    def wait_no_leaks(self, timeout_s: float = 30.0) -> dict[str, int]:
        """``leaked_blocks()`` once every worker has freed what finished requests
        held (aborts reach workers asynchronously), or as it stands at the timeout."""
        deadline = time.monotonic() + timeout_s
        while (leaks := self.leaked_blocks()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return leaks

    def stop(self) -> None:
        try:
            self.run(self.server.stop(5.0), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
