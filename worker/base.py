"""What prefill, decode and colocated workers share: an engine on its own
thread, the pool adapter for KV transfers, per-request output routing into
the worker's event loop, and the output streams to the routers
(worker/output_channel.py), which carry the prefix cache's events to the
routers' in-process index. With the index in Redis the events go there
instead, and the streams carry none."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from block_index import EventPublisher, KVEvent
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.spec.decoder import spec_stats
from kv_transfer import PoolBlockStore, TransferConfig
from kv_transfer.quantized import QuantizedBlockStore
from net.local_socket import host_identity
from protocol.outputs import RequestOutput
from protocol.workers import WorkerHealth
from worker.cpu_binding import bind_process
from worker.heap import freeze_startup_heap
from worker.logfmt import LogFormat, configure_logging
from worker.output_channel import OutputServer
from worker.sched_policy import set_niceness, set_policy

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class IndexSettings:
    """Where a worker publishes its prefix cache's changes."""

    redis_url: str | None = None  # None: on the output streams, to the routers' index
    deployment: str = "default"
    heartbeat_s: float = 2.0
    ttl_s: float = 10.0


class EngineWorker:
    def __init__(self, name: str, config: EngineConfig, index: IndexSettings | None = None) -> None:
        self.name = name
        self.engine = LLMEngine(config)
        self.publisher = self._make_publisher(index or IndexSettings())
        self.loop = EngineLoop(
            self.engine, self._on_outputs, f"{name}-engine", self._on_cache_events
        )
        self.store = PoolBlockStore(self.engine.block_pool, self.engine.kv_cache, self.loop.lock)
        if config.kv_transfer_dtype != "auto":  # quantized KV on the wire
            self.store = QuantizedBlockStore(self.store, config.kv_transfer_dtype)
        self.outputs: OutputServer | None = None  # bound by open_outputs()
        self._aio: asyncio.AbstractEventLoop | None = None
        self._listeners: dict[str, Callable[[RequestOutput], None]] = {}
        self.initial_free_blocks = self.engine.block_pool.num_free
        self.initial_num_holders = self.engine.block_pool.num_holders  # the engine's own
        self.incarnation = uuid.uuid4().hex
        self.started = False

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
        )

    def open_outputs(self, host: str, transfer: TransferConfig) -> OutputServer:
        """Listen for the routers' output streams (before start_loop)."""
        self.outputs = OutputServer(
            host,
            transfer.security,
            self._router_gone,
            transfer.max_message_bytes,
            local=transfer.local_streams,
        )
        return self.outputs

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
            free, n = self.engine.block_pool.num_free, 0
        else:
            free, n = await self.loop.acall(lambda e: (e.block_pool.num_free, len(e.request_ids())))
        return WorkerHealth(
            self.name, self.incarnation, self.started, free, self.initial_free_blocks, n
        )

    def stop_loop(self) -> None:
        self.loop.stop()
        self.publisher.close()

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

    def describe(self) -> dict:
        """What the router needs to know about this worker."""
        engine = self.engine
        info = {
            "name": self.name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.spec.vocab_size,
            "model_fingerprint": engine.kv_layout.model_fingerprint,
            "incarnation": self.incarnation,
        }
        if self.outputs is not None:  # where routers open its output stream
            local = self.outputs.local_address
            info["outputs"] = self.outputs.address
            info["outputs_local"] = local
            info["host_id"] = host_identity() if local else ""  # who can reach outputs_local
        return info

    def stats(self) -> dict[str, int]:
        engine = self.engine
        return {
            "free_blocks": engine.block_pool.num_free,
            "total_blocks": engine.block_pool.num_blocks,
            "initial_free_blocks": self.initial_free_blocks,
            "num_holders": engine.block_pool.num_holders,
            "initial_num_holders": self.initial_num_holders,
            "num_requests": len(engine.request_ids()),
            "num_running": len(engine.scheduler.running),
            "num_waiting": len(engine.scheduler.waiting),
            "num_steps": self.loop.num_steps,
            "num_preemptions": engine.scheduler.num_preemptions,
            **spec_stats(engine.speculator),
        }

    def drain_events(self) -> list[KVEvent]:
        """Cache events not yet sent to the routers (in-process index only)."""
        return self.publisher.drain() if isinstance(self.publisher, BufferedEvents) else []

    def publish_outputs(self, outputs: list[RequestOutput]) -> None:
        """On the engine thread: ``outputs`` to the routers that own their
        requests, and the cache events not sent yet to every router (none
        with the index in Redis), on the output streams."""
        if self.outputs is None:
            return
        try:
            self.outputs.publish(outputs, self.drain_events())
        except Exception:  # the engine thread must go on
            log.exception("publishing a step's outputs failed")

    def _router_gone(self, router_id: str, request_ids: list[str]) -> None:
        """A router's output stream closed (in its connection's thread), with
        the requests it owned here (none on a prefill worker)."""

    def cached_hashes(self) -> list[bytes]:
        with self.loop.lock:
            return self.engine.block_pool.cached_hashes()

    def _on_cache_events(self, stored: list[bytes], removed: list[bytes]) -> None:
        self.publisher.publish(KVEvent(self.name, tuple(stored), tuple(removed)))

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._listeners.get(out.request_id)
            if callback is not None:
                callback(out)


class WorkerActor:
    """What every worker's Ray actor does; the pool manager makes a subclass
    remote with ``ray.remote(...).options(resources)``. Subclasses set
    ``worker_class`` and add their role's calls."""

    worker_class: type[EngineWorker]

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        transfer: TransferConfig,
        index: IndexSettings,
        host: str | None,
        log_format: LogFormat = "text",
        batch_scheduling: bool = False,
        cpu_cores: tuple[int, ...] | None = None,
        niceness: int | None = None,
    ) -> None:
        """``batch_scheduling``: this process runs under SCHED_BATCH (prefill
        workers, see worker/sched_policy.py); otherwise under the normal policy.
        ``cpu_cores``: the cores this process is bound to (worker/cpu_binding.py),
        before the engine starts its threads; None: as inherited. ``niceness``:
        this process's nice value (sched_policy.set_niceness); None: Ray's."""
        configure_logging(log_format)  # this actor's process: structured request events
        set_policy(batch_scheduling)
        if niceness is not None:
            set_niceness(niceness)
        if cpu_cores is not None:
            bind_process(cpu_cores)
        if host is None:  # the address Ray gives this node, so peers on other nodes reach it
            import ray

            host = ray.util.get_node_ip_address()
        self.worker = self.worker_class(name, config, transfer, index, host)
        freeze_startup_heap()  # this process serves this one worker until it exits

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> dict:
        return self.worker.stats()

    async def health(self) -> WorkerHealth:
        return await self.worker.health()

    async def pid(self) -> int:
        """The actor's process id (chaos tests kill it)."""
        return os.getpid()

    async def stop(self) -> None:
        await self.worker.stop()
