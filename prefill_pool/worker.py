"""The prefill worker (a plain class; the Ray actor wraps it).

A request's prompt joins the engine's batch (chunked under the token
budget), its first token is sampled, then its KV blocks are pushed to the
decode worker the router named, with that token and what the decode needs
to start the request (protocol/decode_start.py), and released here. The decode
worker answers the push's header with the leading blocks it holds already;
only the rest is sent. Full blocks stay in this worker's prefix cache. The
request's tokens reach the router from the decode worker alone: this call
returns what the prefill cost, not tokens.

The prefix cache's changes go to the routers on this worker's output
streams (worker/output_channel.py), which carry nothing else, as soon as
the engine thread reports them (or to Redis, with the index there). The
reply names how many batches of them were out by then (``events_seq``),
so that the router can wait for its stream to have brought them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

import grpc

from block_index import IndexSettings
from engine.block_pool import Held
from engine.config import EngineConfig
from engine.detokenizer import stop_matcher
from engine.hashing import BlockHash, hash_blocks, root_hash
from engine.llm_engine import LLMEngine
from engine.parallel.setup import RankLauncher
from kv_transfer import (
    GrpcKVClient,
    GrpcKVServer,
    PushResult,
    TransferConfig,
    TransferError,
)
from kv_transfer.feed import KVFeed
from kv_transfer.interface import PushHeader
from prefill_pool.push import first_token, push_feed, push_header
from protocol.outputs import RequestFailed, RequestOutput
from protocol.requests import PrefillRequest, PrefillResult
from protocol.workers import WorkerInfo, WorkerStats
from worker.base import EngineWorker
from worker.logfmt import log_event

log = logging.getLogger(__name__)


class PrefillWorker(EngineWorker):
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
        self.transfer_config = transfer or TransferConfig()
        self._client: GrpcKVClient | None = None
        # Serves pulls of this worker's cached prefix blocks by other workers.
        self.kv_server = GrpcKVServer(self.store, self.transfer_config, host=host, port=0)
        self.kv_bytes_pushed = 0
        self.kv_bytes_pulled = 0

    async def start(self) -> None:
        self.open_outputs(self.host, self.transfer_config)
        self.start_loop()
        self._client = GrpcKVClient(self.transfer_config)
        await self.kv_server.start()

    def describe(self) -> WorkerInfo:
        return dataclasses.replace(super().describe(), kv_address=self.kv_server.address)

    async def stop(self) -> None:
        self.close_outputs()
        if self._client is not None:
            await self._client.close()
        await self.kv_server.stop(1.0)
        self.stop_loop()

    def stats(self) -> WorkerStats:
        return dataclasses.replace(
            super().stats(),
            kv_bytes_pushed=self.kv_bytes_pushed,
            kv_bytes_pulled=self.kv_bytes_pulled,
            num_transfer_leases=len(self.kv_server.service.leases),
        )

    async def _pull_prefix(self, req: PrefillRequest) -> Held | None:
        """Fetch prefix blocks from the worker that holds them, into this pool's
        prefix cache; returns them (held by the pull's lease holder until the
        prompt is admitted). A failed pull only costs the recompute."""
        if not req.pull_from or not req.pull_hashes or self.store.layout.wire_dtype:
            return None  # quantized KV is never indexed as exact (kv_transfer/chain.py)
        assert self._client is not None, "worker not started"
        tokens = self._asked_tokens(req)
        if tokens is None:
            log.warning("pull for %s: the router's hashes are not its prompt's", req.request_id)
            return None
        try:
            pulled = await self._client.pull(
                req.pull_from,
                self.store,
                req.pull_hashes,
                request_id=req.request_id,
                grant=req.pull_grant,
                token_ids=tokens,
            )
        except TransferError as exc:
            log.warning("pull for %s from %s failed: %s", req.request_id, req.pull_from, exc)
            return None
        self.kv_bytes_pulled += pulled.bytes_received
        return pulled.held

    def _asked_tokens(self, req: PrefillRequest) -> list[int] | None:
        """The tokens of the blocks a pull asks for, found by hashing the
        request's own tokens with its salt; None if its chain has no such run."""
        layout, bs = self.store.layout, self.store.layout.block_size
        tokens = req.prompt_token_ids + req.output_token_ids
        chain = hash_blocks(tokens, bs, root_hash(layout.model_fingerprint, bs), req.cache_salt)
        asked = [BlockHash(h) for h in req.pull_hashes]
        with contextlib.suppress(ValueError):
            at = chain.index(asked[0])
            if chain[at : at + len(asked)] == asked:
                return tokens[at * bs : (at + len(asked)) * bs]
        return None

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        rid = req.request_id
        first: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.listen(rid, lambda out: first.done() or first.set_result(out))
        start = time.perf_counter()
        pulled: Held | None = None
        feed = push_feed(req, self.store, self.loop.lock, self.engine.max_model_len)
        push: asyncio.Task[PushResult] | None = None
        try:
            pulled = await self._pull_prefix(req)
            matcher = await asyncio.to_thread(stop_matcher, req.params.stop)
            streamed = self.transfer_config.stream_push and feed.num_blocks > 0
            await self.loop.acall(
                lambda e: e.add_request(
                    rid,
                    req.prompt_token_ids,
                    req.params,
                    True,
                    req.output_token_ids,
                    matcher,
                    req.cache_salt,
                    feed.progress if streamed else None,
                )
            )
            header = push_header(req, self.store.layout)
            push = asyncio.ensure_future(self._push(req.decode_kv_address, header, feed))
            await asyncio.wait([first, push], return_when=asyncio.FIRST_COMPLETED)
            if not first.done():  # the push failed (refused, no room) while the prefill ran
                push.result()
            out = first.result()
        except BaseException:
            feed.fail(TransferError(grpc.StatusCode.CANCELLED, "the prefill failed"))
            await asyncio.shield(self.abort(rid))
            await _settled(push)
            feed.close()  # the push closes it too, but there may be no push yet
            raise
        finally:
            self.unlisten(rid)
            if pulled is not None:  # the request holds its own references by now
                self.store.release(pulled.holder, pulled.block_ids)
        prefilled = time.perf_counter()
        if out.finish_reason in ("abort", "error"):
            feed.fail(TransferError(grpc.StatusCode.CANCELLED, "the request ended"))
            await _settled(push)
            if out.finish_reason == "error":  # the engine failed it alone and freed its blocks
                raise RequestFailed(out.error or "no reason given")
            # The abort may have come before the add: drop it.
            await asyncio.shield(self.loop.acall(lambda e: e.abort(rid)))
            return PrefillResult(rid, True, 0, 0, prefilled - start, 0.0, self._events_seq())
        try:
            self.loop.call_here(lambda e: _finish(e, rid, out, feed))
            pushed = await push
            self.kv_bytes_pushed += pushed.bytes_sent
        finally:
            await _settled(push)
            feed.close()
            if not out.finished:
                self.loop.call_here(lambda e: e.abort(rid))
        done = time.perf_counter()
        log_event(
            log,
            "prefill_done",
            request_id=rid,
            worker=self.name,
            prompt_tokens=len(req.prompt_token_ids),
            cached_tokens=out.num_cached_tokens,
            held_blocks=pushed.held_blocks,
            pushed_blocks=feed.num_blocks - pushed.held_blocks,
            kv_bytes=pushed.bytes_sent,
            prefill_ms=round((prefilled - start) * 1e3, 2),
            transfer_ms=round((done - prefilled) * 1e3, 2),
        )
        return PrefillResult(
            rid,
            False,
            pushed.bytes_sent,
            pushed.held_blocks,
            prefilled - start,
            done - prefilled,
            self._events_seq(),
        )

    def _events_seq(self) -> int:
        return self.outputs.events_seq if self.outputs is not None else 0

    def _on_cache_events(
        self, stored: list[bytes], removed: list[bytes], host: Sequence[bytes] = ()
    ) -> None:
        """On the engine thread: out to the routers at once, before the step's
        outputs reach the event loop (so a reply counts them)."""
        super()._on_cache_events(stored, removed, host)
        self.publish_outputs([])

    async def _push(self, address: str, header: PushHeader, feed: KVFeed) -> PushResult:
        """Push the request to the decode worker at ``address`` as ``feed`` has
        its KV: every prefill's KV leaves this worker here (a subclass may wrap it)."""
        assert self._client is not None, "worker not started"
        return await self._client.stream(address, header, feed)


def _finish(engine: LLMEngine, request_id: str, out: RequestOutput, feed: KVFeed) -> None:
    """The prefill is done (under the engine's lock): the feed pins what it
    lacks of the request's blocks (taken out of the batch) and gets the first
    token. A request its first token ended has no blocks left: what the feed
    pinned as they were computed goes, or none (kv_transfer/feed.py)."""
    blocks = None if out.finished else engine.export_kv(request_id, with_data=False).block_ids
    feed.finish(blocks, first_token(out))


async def _settled(task: asyncio.Task | None) -> None:
    """Cancel ``task`` unless done, and wait for it; its error is not the news."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()
