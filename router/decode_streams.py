"""The router's end of the decode workers' output streams.

One DecodeOutputs stream per decode worker carries every step's deltas for
this router's requests there (and the workers' cache events). Each request
reads its deltas from a queue; when a worker's stream breaks, every request
on that worker gets ``LOST`` and the backend hears of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

import grpc

from engine.transfer import TransferConfig
from engine.transfer.grpc_server import message_limits
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from router.pool_manager import WorkerHandle

log = logging.getLogger(__name__)

LOST: Final = None  # put in a request's queue when its worker's stream broke
DeltaQueue = asyncio.Queue[worker_pb2.RequestDelta | None]


class DecodeStreams:
    def __init__(
        self,
        router_id: str,
        on_events: Callable[[list[worker_pb2.CacheEvent]], None],
        on_broken: Callable[[WorkerHandle, str], None],
        transfer: TransferConfig,
    ) -> None:
        """``transfer``: the cluster's credentials and message limits, which the
        workers' output-stream servers demand."""
        self.router_id = router_id
        self.transfer = transfer
        self.on_events = on_events
        self.on_broken = on_broken
        self._queues: dict[str, tuple[DeltaQueue, WorkerHandle]] = {}  # request id ->
        self._readers: dict[str, asyncio.Task] = {}  # decode worker name -> reader
        self._channels: dict[str, grpc.aio.Channel] = {}  # decode worker name -> channel

    def register(self, request_id: str, worker: WorkerHandle) -> DeltaQueue:
        queue: DeltaQueue = asyncio.Queue()
        self._queues[request_id] = (queue, worker)
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def subscribe(self, worker: WorkerHandle) -> None:
        await self.unsubscribe(worker)
        security = self.transfer.security
        channel = security.channel(worker.info["outputs"], message_limits(self.transfer))
        self._channels[worker.name] = channel
        stream = worker_pb2_grpc.DecodeOutputsStub(channel).Subscribe(
            worker_pb2.SubscribeRequest(router_id=self.router_id), metadata=security.metadata()
        )
        await stream.read()  # the empty batch that opens the stream
        self._readers[worker.name] = asyncio.create_task(self._read(worker, stream))

    async def unsubscribe(self, worker: WorkerHandle) -> None:
        task = self._readers.pop(worker.name, None)
        if task is not None:
            task.cancel()
        channel = self._channels.pop(worker.name, None)
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close()

    async def close(self) -> None:
        for task in self._readers.values():
            task.cancel()
        for channel in self._channels.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._readers.clear()
        self._channels.clear()

    async def _read(self, worker: WorkerHandle, stream) -> None:
        broken = "the stream ended"
        try:
            while (batch := await stream.read()) is not grpc.aio.EOF:
                self.on_events(batch.cache_events)
                for delta in batch.deltas:
                    entry = self._queues.get(delta.request_id)
                    if entry is not None:
                        entry[0].put_nowait(delta)
        except asyncio.CancelledError:
            broken = ""  # unsubscribed: the worker is gone from routing already
            raise
        except grpc.aio.AioRpcError as exc:
            broken = f"output stream broke: {exc.code().name}"
        except Exception as exc:
            log.exception("reading the output stream of %s failed", worker.name)
            broken = f"output stream failed: {type(exc).__name__}"
        finally:
            # Requests on that worker can no longer finish there.
            for queue, owner in list(self._queues.values()):
                if owner is worker:
                    queue.put_nowait(LOST)
            if broken:
                self.on_broken(worker, broken)
