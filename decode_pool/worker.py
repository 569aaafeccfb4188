"""The decode worker (a plain class; the Ray actor wraps it).

A prefill worker pushes a request's KV blocks here (kv_transfer/), with
what the request needs to start (protocol/decode_start.py). In the push's
handshake this worker takes the leading blocks its prefix cache holds
already, so only the rest is sent. Once the push commits, the request joins
continuous batching and its first token (the prefill's) goes out as the
first frame of its router's output stream: every token of a request reaches
the router by that one stream (worker/output_channel.py), with this
worker's cache events. ``start_full`` prefills
here instead (colocated mode, or a short tail after a cached prefix).

Pushes and new requests take blocks through the worker's reserve
(decode_pool/reserve.py), so none of them can make a running sequence
short; a push that does not fit waits for room. The room left is reported
to every router on the output streams whenever it changes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc

from block_index import IndexSettings
from decode_pool.reserve import PushReserve
from engine.config import EngineConfig
from engine.detokenizer import stop_matcher
from engine.llm_engine import LLMEngine
from engine.parallel.setup import RankLauncher
from kv_transfer import CommittedPush, GrpcKVServer, TransferConfig, TransferError
from protocol.decode_start import BadStart, DecodeStart, FirstToken
from protocol.outputs import RequestOutput
from protocol.requests import DecodeRequest
from protocol.workers import WorkerInfo, WorkerStats
from protos.tandem.v1 import worker_pb2
from worker.base import EngineWorker
from worker.logfmt import log_event

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        transfer: TransferConfig | None = None,
        index: IndexSettings | None = None,
        host: str = "127.0.0.1",
        ranks: RankLauncher | None = None,
    ) -> None:
        super().__init__(name, config, index, ranks)
        self.host = host
        self.transfer = transfer or TransferConfig()
        self.kv_server = GrpcKVServer(self.store, self.transfer, host=host, port=0, handler=self)
        self._background: set[asyncio.Future] = set()
        # request id -> when to forget it: aborted requests, so that a call for
        # one that arrives late (the router gave up on a hung try) is refused.
        self._aborted: dict[str, float] = {}
        self.reserve = PushReserve(self.engine, self.transfer.lease_s)
        self.pool_store.admit = self.reserve.admit
        self.pool_store.on_held = self.reserve.held
        self.loop.after_pass = self._report_room
        self._room: int | None = None  # as last reported (engine thread)

    async def start(self) -> None:
        self.open_outputs(self.host, self.transfer)
        self._report_room()  # every router's stream opens with it (OPEN)
        self.start_loop()
        await self.kv_server.start()

    def describe(self) -> WorkerInfo:
        return dataclasses.replace(super().describe(), kv_address=self.kv_server.address)

    async def stop(self) -> None:
        self.close_outputs()
        await self.kv_server.stop(1.0)
        for rid in await self.loop.acall(lambda e: e.request_ids()):
            await self.abort(rid)
        self.stop_loop()

    # ---- pushes (kv_transfer's PushHandler, on the event loop) ----

    def check(self, request_id: str, decode_start: bytes) -> None:
        """Refuse a push before it reserves a block: one that starts no
        request, a request aborted here, or one whose router has no stream."""
        try:
            start = DecodeStart.decode(decode_start)
        except BadStart as exc:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if self._was_aborted(request_id):
            raise TransferError(grpc.StatusCode.CANCELLED, f"request {request_id!r} was aborted")
        if self.outputs is None or not self.outputs.has_router(start.router_id):
            raise TransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"router {start.router_id} has no open output stream here",
            )
        with self.loop.lock:
            self.reserve.expect(request_id, start)

    def committed(self, push: CommittedPush) -> None:
        """Start a pushed request: its first token is the first frame of its
        stream, then it joins the batch. The blocks are the request's now."""
        rid = push.request_id
        start = DecodeStart.decode(push.decode_start)  # checked at the header
        try:
            first_token = FirstToken.decode(push.first_token)
        except BadStart as exc:  # a broken sender: the request cannot start
            log.warning("request %s could not start: %s", rid, exc)
            first_token = None
        refused = self._was_aborted(rid) or not self._own(rid, start.router_id)
        if refused or first_token is None:

            def drop(engine) -> None:
                self.reserve.settled(rid)  # its blocks leave the push's lease here
                engine.block_pool.release_held([push.blocks])
                if not refused:  # its router learns it failed
                    self.publish_outputs([RequestOutput.aborted(rid)], self._room_change())

            self._on_engine(drop)
            return
        tokens = push.token_ids + push.next_token_ids
        prompt, outputs = tokens[: start.num_prompt_tokens], tokens[start.num_prompt_tokens :]
        first = first_token.output(rid, push.next_token_ids, start.num_prompt_tokens)
        matcher = stop_matcher(start.params.stop)  # here, not on the engine thread
        log_event(
            log,
            "decode_start",
            request_id=rid,
            worker=self.name,
            prompt_tokens=start.num_prompt_tokens,
            reused_blocks=push.held_blocks,
            received_blocks=len(push.blocks.block_ids) - push.held_blocks,
        )

        def begin(engine) -> None:
            out = first
            self.reserve.settled(rid)  # the scheduler counts it from here
            try:
                if first.finished:
                    engine.block_pool.release_held([push.blocks])
                else:  # the request holds the blocks now (freed if it is refused)
                    engine.add_prefilled_request(
                        rid,
                        prompt,
                        outputs,
                        start.params,
                        [push.blocks],
                        matcher,
                        push.cache_salt,
                    )
            except Exception as exc:
                log.warning("request %s could not start: %s", rid, exc)
                out = RequestOutput.aborted(rid)
            self.publish_outputs([out], self._room_change())  # and the commit's cache events

        self._on_engine(begin)

    def stats(self) -> WorkerStats:
        return dataclasses.replace(
            super().stats(),
            num_push_preemptions=self.reserve.num_push_preemptions,
            num_expected_pushes=self.reserve.num_expected(),
            num_transfer_leases=len(self.kv_server.service.leases),
        )

    def _report_room(self) -> None:
        """After each pass of the engine loop: the KV room to the routers when
        it changed since the last report."""
        room = self._room_change()
        if room is not None:
            self.publish_outputs([], room)

    def _room_change(self) -> worker_pb2.KVRoom | None:
        """On the engine thread: the KV room if it changed since the last
        report, else None; a wake-up for pushes waiting for room when it grew.
        A request's first output carries it: the router settles its promise
        on that output, so a room sent later would leave a moment in which
        the router counts the request's blocks nowhere."""
        with self.loop.lock:
            room = self.reserve.room()
            total = self.engine.block_pool.num_blocks
        if room == self._room or self.outputs is None:
            return None
        grew = self._room is None or room > self._room
        self._room = room
        if grew and self._aio is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed
                self._aio.call_soon_threadsafe(self.kv_server.service.notify_room)
        return worker_pb2.KVRoom(free_blocks=room, total_blocks=total)

    def _on_engine(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run ``fn`` on the engine thread; its failure is logged, not lost."""
        self.loop.call(fn).add_done_callback(_log_failure)

    async def start_full(self, req: DecodeRequest) -> None:
        """Prefill and decode here (colocated mode, or a short uncached rest);
        every new token goes to the stream. ``output_token_ids``, when set, are
        tokens streamed before a failover: computed with the prompt, not sent."""
        self._refuse_aborted(req.request_id)
        if not self._own(req.request_id, req.router_id):
            raise ConnectionError(f"router {req.router_id} has no open output stream here")
        log_event(
            log,
            "colocated_start",
            request_id=req.request_id,
            worker=self.name,
            prompt_tokens=len(req.prompt_token_ids),
        )
        try:
            matcher = await asyncio.to_thread(stop_matcher, req.params.stop)
            await self.loop.acall(
                lambda e: e.add_request(
                    req.request_id,
                    req.prompt_token_ids,
                    req.params,
                    False,
                    req.output_token_ids,
                    matcher,
                    req.cache_salt,
                )
            )
        except BaseException:
            self._disown(req.request_id)
            raise

    async def abort(self, request_id: str) -> bool:
        now = time.monotonic()
        if len(self._aborted) > 1024:
            self._aborted = {r: t for r, t in self._aborted.items() if t > now}
        self._aborted[request_id] = now + self.transfer.lease_s
        self._disown(request_id)
        self.kv_server.discard(request_id)
        return await super().abort(request_id)

    def _was_aborted(self, request_id: str) -> bool:
        return self._aborted.get(request_id, 0.0) > time.monotonic()

    def _refuse_aborted(self, request_id: str) -> None:
        if self._was_aborted(request_id):
            raise LookupError(f"request {request_id!r} was aborted")

    def _own(self, request_id: str, router_id: str) -> bool:
        """Send the request's outputs to ``router_id``; False if it has no stream."""
        return self.outputs is not None and self.outputs.own(request_id, router_id)

    def _disown(self, request_id: str) -> None:
        if self.outputs is not None:
            self.outputs.disown(request_id)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """On the engine thread, after each step: straight to the routers,
        with the cache events since the last step's and the room."""
        self.publish_outputs(outputs, self._room_change())
        for out in outputs:
            if out.finished:
                log_event(
                    log,
                    "decode_done",
                    request_id=out.request_id,
                    worker=self.name,
                    finish_reason=out.finish_reason,
                    output_tokens=out.num_output_tokens,
                    cached_tokens=out.num_cached_tokens,
                )

    def _router_gone(self, router_id: str, request_ids: list[str]) -> None:
        """A router's stream closed (in its connection's thread): abort what it owned."""
        if not request_ids or self._aio is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nothing to abort
            self._aio.call_soon_threadsafe(self._abort_all, request_ids)

    def _abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = asyncio.ensure_future(self.abort(rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)


def _log_failure(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("an engine call failed", exc_info=future.exception())
