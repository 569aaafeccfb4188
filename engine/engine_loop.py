"""Runs an LLMEngine on a thread of its own, for async servers.

The engine is not thread-safe. Its thread steps it whenever there is work
and runs the calls that others submit (add, abort, export, attach) between
steps, all under ``lock``; a KV transfer server shares that lock for its
pool bookkeeping. A step lets go of the lock while the model computes, so
a transfer waits for the step's bookkeeping, never for its forward pass.
Each step's outputs go to ``on_outputs`` from the engine thread: the owner
hands them to its event loop. So do the prefix cache's changes (block
hashes stored and evicted), for the block index.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.llm_engine import LLMEngine
from protocol.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    JOIN_TIMEOUT_S = 30.0  # stop() waits this long for the step in flight

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: Callable[[list[RequestOutput]], None],
        name: str = "engine",
        on_cache_events: Callable[[list[bytes], list[bytes], list[bytes]], None] | None = None,
        after_pass: Callable[[], None] | None = None,
    ) -> None:
        """``after_pass``: called on the engine thread after every pass of the
        loop (a step, or the calls run while idle), outside ``lock``.
        ``on_cache_events(stored, removed, host)``: the prefix cache's net
        change; ``host`` is the part of ``stored`` only in the second tier."""
        self.engine = engine
        self.after_pass = after_pass
        self.lock = threading.RLock()
        self._on_outputs = on_outputs
        self._on_cache_events = on_cache_events
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], object], Future]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> bool:
        """End the loop after the step in flight; False if its thread is still
        in that step after ``JOIN_TIMEOUT_S`` (it may yet use the engine)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.JOIN_TIMEOUT_S)
        return not self._thread.is_alive()

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps."""
        future: Future[T] = Future()
        if self._stopping:
            future.set_exception(RuntimeError("engine loop is stopped"))
            return future
        self._calls.put((fn, future))
        self._wake.set()
        return future

    async def acall(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def call_here(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` in the calling thread under ``lock``, without
        waiting for the step in flight to end. Only for what a step's forward
        pass does not touch: the block pool, and requests outside the batch
        (a prefilled request waiting for its push)."""
        with self.lock:
            return fn(self.engine)

    def _run(self) -> None:
        while not self._stopping:
            self._run_calls()
            with self.lock:
                busy = self.engine.has_unfinished()
                outputs = self._step() if busy else []
                delta = self.engine.block_pool.drain_delta()
            stored = delta.device + delta.host
            if (stored or delta.removed) and self._on_cache_events is not None:
                self._on_cache_events(stored, delta.removed, delta.host)
            if outputs:
                self._on_outputs(outputs)
            if self.after_pass is not None:
                self.after_pass()
            if not busy:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
        self._run_calls()

    def _step(self) -> list[RequestOutput]:
        """One engine step. The engine fails a request alone for a fault tied
        to it (engine/llm_engine.py ``step``); what still escapes it (the
        scheduler or the speculator's proposals raised) leaves the engine's
        state in doubt: every request is aborted, which the router takes as a
        lost worker, and the step counts as failed."""
        try:
            outputs = self.engine.step(pool_lock=self.lock)
        except Exception:  # a broken step must not kill the worker silently
            log.exception("engine step failed; aborting every request")
            self.engine.note_failed_step()
            outputs = self._abort_all()
        self.num_steps += 1
        return outputs

    def _abort_all(self) -> list[RequestOutput]:
        outputs = []
        for request_id in list(self.engine.request_ids()):
            self.engine.abort(request_id)
            outputs.append(RequestOutput.aborted(request_id))
        return outputs

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self.lock:
                    result = fn(self.engine)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
