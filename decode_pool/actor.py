"""The Ray actor around a DecodeWorker (decode or colocated)."""

from __future__ import annotations

import dataclasses

from decode_pool.worker import DecodeWorker
from protocol.requests import DecodeRequest
from worker.base import WorkerActor


class DecodeActor(WorkerActor):
    worker_class = DecodeWorker

    async def start(self) -> dict:
        addresses = await self.worker.start()
        return {**self.worker.describe(), **dataclasses.asdict(addresses)}

    async def start_full(self, req: DecodeRequest) -> None:
        await self.worker.start_full(req)
