"""What prefill, decode and colocated workers share: an engine on its own
thread, the pool adapter for KV transfers, and per-request output routing
into the worker's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.sequence import RequestOutput
from engine.transfer import PoolBlockStore


class EngineWorker:
    def __init__(self, name: str, config: EngineConfig) -> None:
        self.name = name
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(self.engine, self._on_outputs, name=f"{name}-engine")
        self.store = PoolBlockStore(self.engine.block_pool, self.engine.kv_cache, self.loop.lock)
        self._aio: asyncio.AbstractEventLoop | None = None
        self._listeners: dict[str, Callable[[RequestOutput], None]] = {}
        self.initial_free_blocks = self.engine.block_pool.num_free

    def start_loop(self) -> None:
        self._aio = asyncio.get_running_loop()
        self.loop.start()

    def stop_loop(self) -> None:
        self.loop.stop()

    def listen(self, request_id: str, callback: Callable[[RequestOutput], None]) -> None:
        """Call ``callback`` (in the event loop) with each output of the request."""
        self._listeners[request_id] = callback

    def unlisten(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    async def abort(self, request_id: str) -> bool:
        return await self.loop.acall(lambda e: e.abort(request_id))

    def describe(self) -> dict:
        """What the router needs to know about this worker."""
        engine = self.engine
        return {
            "name": self.name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.spec.vocab_size,
            "model_fingerprint": engine.kv_layout.model_fingerprint,
        }

    def stats(self) -> dict[str, int]:
        engine = self.engine
        return {
            "free_blocks": engine.block_pool.num_free,
            "total_blocks": engine.block_pool.num_blocks,
            "initial_free_blocks": self.initial_free_blocks,
            "num_requests": len(engine.request_ids()),
            "num_steps": self.loop.num_steps,
            "num_preemptions": engine.scheduler.num_preemptions,
        }

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            callback = self._listeners.get(out.request_id)
            if callback is not None:
                callback(out)
