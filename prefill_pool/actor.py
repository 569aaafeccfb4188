"""The Ray actor around a PrefillWorker."""

from __future__ import annotations

from kv_transfer.faults import TransferFaults
from prefill_pool.worker import PrefillRequest, PrefillResult, PrefillWorker
from worker.base import WorkerActor


class PrefillActor(WorkerActor):
    worker_class = PrefillWorker

    async def start(self) -> dict:
        await self.worker.start()
        return self.worker.describe()

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(req)

    async def set_faults(self, faults: TransferFaults) -> None:
        self.worker.set_faults(faults)
