"""The DecodeOutputs gRPC service: one stream per router, one message per step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from engine.index import KVEvent
from engine.sequence import RequestOutput
from protos.tandem.v1 import generate_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


def to_delta(out: RequestOutput) -> worker_pb2.RequestDelta:
    delta = worker_pb2.RequestDelta(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text=out.text_delta,
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
    for lp in out.logprobs or []:
        delta.logprobs.append(
            generate_pb2.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_logprobs=[generate_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
            )
        )
    return delta


class OutputStreams(worker_pb2_grpc.DecodeOutputsServicer):
    """Routes each step's outputs to the router that owns each request."""

    def __init__(self, on_router_gone: Callable[[str], None]) -> None:
        self._queues: dict[str, asyncio.Queue[worker_pb2.StepBatch | None]] = {}
        self._owner: dict[str, str] = {}  # request id -> router id
        self._on_router_gone = on_router_gone

    def has_router(self, router_id: str) -> bool:
        return router_id in self._queues

    def own(self, request_id: str, router_id: str) -> None:
        self._owner[request_id] = router_id

    def disown(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def requests_of(self, router_id: str) -> list[str]:
        return [r for r, owner in self._owner.items() if owner == router_id]

    def publish(self, outputs: list[RequestOutput], events: list[KVEvent]) -> None:
        batches: dict[str, worker_pb2.StepBatch] = {}
        if events:  # every router keeps an index: each one gets the cache events
            pb_events = [
                worker_pb2.CacheEvent(worker=e.worker, stored=e.stored, removed=e.removed)
                for e in events
            ]
            for router in self._queues:
                batches[router] = worker_pb2.StepBatch(cache_events=pb_events)
        for out in outputs:
            router = self._owner.get(out.request_id)
            if router is None:
                continue
            if out.finished:
                del self._owner[out.request_id]
            batch = batches.setdefault(router, worker_pb2.StepBatch())
            batch.deltas.append(to_delta(out))
        for router, batch in batches.items():
            queue = self._queues.get(router)
            if queue is not None:
                queue.put_nowait(batch)

    def close(self) -> None:
        for queue in self._queues.values():
            queue.put_nowait(None)

    async def Subscribe(self, request: worker_pb2.SubscribeRequest, context):
        router = request.router_id
        if router in self._queues:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"router {router} is subscribed")
        queue: asyncio.Queue[worker_pb2.StepBatch | None] = asyncio.Queue()
        self._queues[router] = queue
        try:
            yield worker_pb2.StepBatch()  # tells the router the stream is open
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            del self._queues[router]
            log.info("router %s unsubscribed", router)
            self._on_router_gone(router)
