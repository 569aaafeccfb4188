"""The Ray actor around a PrefillWorker."""

from __future__ import annotations

from prefill_pool.worker import PrefillWorker
from protocol.requests import PrefillRequest, PrefillResult
from worker.base import WorkerActor


class PrefillActor(WorkerActor):
    worker_class = PrefillWorker

    async def start(self) -> dict:
        await self.worker.start()
        return self.worker.describe()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(req)
