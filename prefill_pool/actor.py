"""The Ray actor around a PrefillWorker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.requests import PrefillRequest, PrefillResult
from worker.actor import WorkerActor

if TYPE_CHECKING:
    from prefill_pool.worker import PrefillWorker


class PrefillActor(WorkerActor):
    worker: PrefillWorker

    @staticmethod
    def make_worker(name, config, transfer, index, host, **options) -> PrefillWorker:
        from prefill_pool.worker import PrefillWorker

        return PrefillWorker(name, config, transfer, index, host, **options)

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return await self.worker.prefill(req)
