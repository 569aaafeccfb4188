"""The Ray actor around a PrefillWorker."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.transfer import TransferConfig
from engine.worker_base import IndexSettings
from prefill_pool.worker import PrefillRequest, PrefillResult, PrefillWorker


class PrefillActor:
    """Created by the pool manager with ``ray.remote(...)`` and its resources."""

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        transfer: TransferConfig,
        index: IndexSettings,
        host: str | None,
    ) -> None:
        import ray

        # Bind to the address Ray gives this node, so peers on other nodes reach it.
        host = host or ray.util.get_node_ip_address()
        self.worker = PrefillWorker(name, config, transfer, index, host)

    async def start(self) -> dict:
        await self.worker.start()
        return self.worker.describe()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.worker.stats()

    async def stop(self) -> None:
        await self.worker.stop()
