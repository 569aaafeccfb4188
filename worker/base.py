"""What prefill, decode and colocated workers share: an engine on its own
thread, the pool adapter for KV transfers, per-request output routing into
the worker's event loop, and the output streams to the routers
(worker/output_channel.py), which carry the prefix cache's events to the
routers' in-process index. With the index in Redis the events go there
instead, and the streams carry none."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable, Sequence

from block_index import EventPublisher, IndexSettings, KVEvent
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.kv_tier import KVTier
from engine.llm_engine import LLMEngine
from engine.parallel.setup import RankLauncher
from engine.spec.decoder import spec_stats
from kv_transfer import PoolBlockStore, TransferConfig
from kv_transfer.quantized import QuantizedBlockStore
from kv_transfer.sharded_store import ShardedBlockStore
from net.local_socket import host_identity
from protocol.outputs import RequestOutput
from protocol.workers import WorkerHealth, WorkerInfo, WorkerStats
from protos.tandem.v1 import worker_pb2
from worker.output_channel import OutputServer

log = logging.getLogger(__name__)


def tier_stats(tier: KVTier | None) -> dict[str, int]:
    """The host tier's WorkerStats fields."""
    if tier is None:
        return {}
    s = tier.stats
    return {
        "kv_tier_capacity_blocks": s.capacity_blocks,
        "kv_tier_blocks": len(tier),
        "kv_tier_hit_blocks": s.hits,
        "kv_tier_bytes_in": s.bytes_in,
        "kv_tier_bytes_out": s.bytes_out,
    }


class BufferedEvents:
    """An EventPublisher that keeps events until the engine thread sends them
    on the output streams (the in-process index's feed)."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def publish(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[KVEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def close(self) -> None:
        self.drain()


class EngineWorker:
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        index: IndexSettings | None = None,
        ranks: RankLauncher | None = None,
    ) -> None:
        """``ranks``: starts the other ranks of a tensor-parallel engine (Ray
        actors, worker/tp_ranks.py); None: local processes."""
        self.name = name
        self.engine = LLMEngine(config, ranks)
        self.publisher = self._make_publisher(index or IndexSettings())
        self.loop = EngineLoop(
            self.engine, self._on_outputs, f"{name}-engine", self._on_cache_events
        )
        self.pool_store = self._pool_store()
        self.store = self.pool_store
        if config.kv_transfer_dtype != "auto":  # quantized KV on the wire
            self.store = QuantizedBlockStore(self.pool_store, config.kv_transfer_dtype)
        self.outputs: OutputServer | None = None  # bound by open_outputs()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._listeners: dict[str, Callable[[RequestOutput], None]] = {}
        self.initial_free_blocks = self.engine.block_pool.num_free
        self.initial_num_holders = self.engine.block_pool.num_holders  # the engine's own
        self.incarnation = uuid.uuid4().hex
        self.started = False

    def _pool_store(self) -> PoolBlockStore:
        """The transfers' view of the pool: whole blocks gathered from and
        scattered to every rank when the engine is tensor-parallel."""
        engine = self.engine
        if engine.tp is not None and engine.tp.kv is not None:
            return ShardedBlockStore(
                engine.block_pool, engine.kv_cache, engine.tp.kv, self.loop.lock
            )
        return PoolBlockStore(engine.block_pool, engine.kv_cache, self.loop.lock)

    def _make_publisher(self, index: IndexSettings) -> EventPublisher:
        if index.redis_url is None:
            return BufferedEvents()
        from block_index import RedisEventPublisher, redis_prefix

        prefix = redis_prefix(index.deployment, self.engine.kv_layout.model_fingerprint)
        return RedisEventPublisher(
            index.redis_url,
            prefix,
            self.name,
            heartbeat_s=index.heartbeat_s,
            ttl_s=index.ttl_s,
            snapshot=self.cached_hashes,
            password=index.redis_password,
        )

    def open_outputs(self, host: str, transfer: TransferConfig) -> OutputServer:
        """Listen for the routers' output streams (before start_loop)."""
        self.outputs = OutputServer(
            host,
            transfer.security,
            self._router_gone,
            transfer.max_message_bytes,
            local=transfer.local_streams,
            ports=transfer.port_range,
            snapshot=self._cache_snapshot if isinstance(self.publisher, BufferedEvents) else None,
        )
        return self.outputs

    def _cache_snapshot(self) -> list[KVEvent]:
        """What the prefix cache holds now, as one event (for a router that logs in)."""
        with self.loop.lock:
            pool = self.engine.block_pool
            stored, host = pool.cached_hashes(), pool.host_hashes()
        return [KVEvent(self.name, tuple(stored), (), host=tuple(host))]

    def close_outputs(self) -> None:
        """End every output stream (the routers see them end)."""
        if self.outputs is not None:
            self.outputs.close()

    def start_loop(self) -> None:
        self._aio = asyncio.get_running_loop()
        self.loop.start()
        self.started = True

    async def health(self) -> WorkerHealth:
        """Answered by the engine thread itself, so a stuck engine fails it."""
        if not self.started:
            free, n, failed = self.engine.block_pool.num_free, 0, 0
        else:
            free, n, failed = await self.loop.acall(
                lambda e: (e.block_pool.num_free, len(e.request_ids()), e.recent_failed_steps())
            )
        return WorkerHealth(
            self.name, self.incarnation, self.started, free, self.initial_free_blocks, n, failed
        )

    def stop_loop(self) -> None:
        ended = self.loop.stop()
        self.publisher.close()
        with self.loop.lock:  # the second KV tier's storage, the other ranks
            self.engine.close(stepping=not ended)

    def listen(self, request_id: str, callback: Callable[[RequestOutput], None]) -> None:
        """Call ``callback`` (in the event loop) with each output of the request."""
        self._listeners[request_id] = callback

    def unlisten(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        """Drop the request and free its blocks; whoever waits on its outputs
        gets a finished "abort" output."""
        found = await self.loop.acall(lambda e: e.abort(request_id))
        callback = self._listeners.get(request_id)
        if callback is not None:
            callback(RequestOutput.aborted(request_id))
        return found

    def describe(self) -> WorkerInfo:
        """What the router needs to know about this worker."""
        engine = self.engine
        local = self.outputs.local_address if self.outputs is not None else ""
        return WorkerInfo(
            name=self.name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.spec.vocab_size,
            model_fingerprint=engine.kv_layout.model_fingerprint,
            incarnation=self.incarnation,
            model_dir=str(engine.model_dir),
            outputs=self.outputs.address if self.outputs is not None else None,
            outputs_local=local or None,
            host_id=host_identity() if local else None,  # who can reach outputs_local
            eos_token_ids=tuple(sorted(engine.eos_token_ids)),
        )

    def stats(self) -> WorkerStats:
        engine = self.engine
        return WorkerStats(
            free_blocks=engine.block_pool.num_free,
            total_blocks=engine.block_pool.num_blocks,
            initial_free_blocks=self.initial_free_blocks,
            num_holders=engine.block_pool.num_holders,
            initial_num_holders=self.initial_num_holders,
            num_requests=len(engine.request_ids()),
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_steps=self.loop.num_steps,
            num_preemptions=engine.scheduler.num_preemptions,
            kv_cached_blocks=engine.block_pool.num_cached,
            kv_prefix_hit_blocks=engine.block_pool.num_hits,
            **tier_stats(engine.kv_tier),
            **spec_stats(engine.speculator),
        )

    def drain_events(self) -> list[KVEvent]:
        """Cache events not yet sent to the routers (in-process index only)."""
        return self.publisher.drain() if isinstance(self.publisher, BufferedEvents) else []

    def publish_outputs(
        self, outputs: list[RequestOutput], room: worker_pb2.KVRoom | None = None
    ) -> None:
        """On the engine thread: ``outputs`` to the routers that own their
        requests, and the cache events not sent yet to every router (none
        with the index in Redis), on the output streams; ``room``: the KV
        room a decode worker reports."""
        if self.outputs is None:
            return
        try:
            self.outputs.publish(outputs, self.drain_events(), room)
        except Exception:  # the engine thread must go on
            log.exception("publishing a step's outputs failed")

    def _router_gone(self, router_id: str, request_ids: list[str]) -> None:
        """A router's output stream closed (in its connection's thread), with
        the requests it owned here (none on a prefill worker)."""

    def cached_hashes(self) -> list[bytes]:
        """The prefix cache's hashes now, under the engine lock (for threads)."""
        with self.loop.lock:
            return self.engine.block_pool.cached_hashes()

    async def cached_blocks(self) -> list[bytes]:
        """``cached_hashes``, taken on the engine thread between steps: the
        caller's event loop (the actor's, which also answers health) goes on
        while a step runs instead of waiting on the engine lock."""
        return await self.loop.acall(lambda engine: engine.block_pool.cached_hashes())

    def _on_cache_events(
        self, stored: list[bytes], removed: list[bytes], host: Sequence[bytes] = ()
    ) -> None:
        event = KVEvent(self.name, tuple(stored), tuple(removed), host=tuple(host))
        self.publisher.publish(event)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._listeners.get(out.request_id)
            if callback is not None:
                callback(out)
