"""The Ray actor around a DecodeWorker (decode or colocated)."""

from __future__ import annotations

from decode_pool.worker import DecodeRequest, DecodeWorker
from engine.config import EngineConfig
from engine.transfer import TransferConfig
from engine.worker_base import IndexSettings


class DecodeActor:
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
        self.worker = DecodeWorker(name, config, transfer, index, host)

    async def start(self) -> dict:
        addresses = await self.worker.start()
        return {**self.worker.describe(), "kv": addresses.kv, "outputs": addresses.outputs}

    async def reserve_prefix(self, request_id: str, block_hashes: list[bytes]) -> int:
        return await self.worker.reserve_prefix(request_id, block_hashes)

    async def start_decode(self, req: DecodeRequest) -> None:
        await self.worker.start_decode(req)

    async def start_full(self, req: DecodeRequest) -> None:
        await self.worker.start_full(req)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.worker.stats()

    async def stop(self) -> None:
        await self.worker.stop()
