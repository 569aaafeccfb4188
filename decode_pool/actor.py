"""The Ray actor around a DecodeWorker (decode or colocated)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.requests import DecodeRequest
from worker.actor import WorkerActor

if TYPE_CHECKING:
    from decode_pool.worker import DecodeWorker


class DecodeActor(WorkerActor):
    worker: DecodeWorker

    @staticmethod
    def make_worker(name, config, transfer, index, host, **options) -> DecodeWorker:
        from decode_pool.worker import DecodeWorker

        return DecodeWorker(name, config, transfer, index, host, **options)

    async def start_full(self, req: DecodeRequest) -> None:
        await self.worker.start_full(req)
