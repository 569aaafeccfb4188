"""A whole tandem deployment (Ray pools + router) inside this process, for
tests and benchmarks.

The router and its backend run on an event loop in a thread of their own,
so callers stay synchronous and talk to it over gRPC like any client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from router.ray_backend import RayBackend
from router.service import RouterServer
from tandem_cli.config import ServeConfig


class Deployment:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.backend = RayBackend(config)
        self.server = RouterServer(
            self.backend,
            host="127.0.0.1",
            port=0,
            max_queued_requests=config.max_queued_requests,
            request_timeout_s=config.request_timeout_s,
            drain_timeout_s=config.grace_period_s,
            max_message_bytes=config.max_message_mb << 20,
            tls_cert=config.tls_cert,
            tls_key=config.tls_key,
        )
        self.run(self.server.start(), timeout=300)
        self.address = self.server.address

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def worker_stats(self) -> dict[str, dict]:
        return self.run(self.backend.worker_stats())

    def leaked_blocks(self) -> dict[str, int]:
        """Workers whose free block count differs from their starting one."""
        return {
            name: s["initial_free_blocks"] - s["free_blocks"]
            for name, s in self.worker_stats().items()
            if s["free_blocks"] != s["initial_free_blocks"] or s["num_requests"]
        }

    def stop(self) -> None:
        try:
            self.run(self.server.stop(5.0), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
