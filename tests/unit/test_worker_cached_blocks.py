"""EngineWorker.cached_blocks (the actor's ``cached_blocks`` call, which the
index reconciliation makes) waits for the engine between steps without
blocking the caller's event loop, which also answers health calls."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import EngineConfig, LLMEngine
from engine.engine_loop import EngineLoop
from worker.actor import WorkerActor
from worker.base import EngineWorker

pytestmark = pytest.mark.unit


def test_cached_blocks_leaves_the_event_loop_free_during_a_step(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=16))
    worker = object.__new__(EngineWorker)  # only what cached_blocks reads
    worker.engine, worker.loop = engine, EngineLoop(engine, lambda outputs: None)
    worker.name = "w"
    worker.loop.start()
    actor = object.__new__(WorkerActor)
    actor.worker = worker
    step_holds_lock, step_may_end = threading.Event(), threading.Event()
    ended_by_the_event_loop: list[bool] = []

    def step() -> None:  # a step in flight on another thread holds the engine lock
        with worker.loop.lock:
            step_holds_lock.set()
            ended_by_the_event_loop.append(step_may_end.wait(10))

    async def main() -> tuple[bytes, ...]:
        call = asyncio.ensure_future(actor.cached_blocks())
        await asyncio.sleep(0)  # the call has started and waits for the step
        step_may_end.set()  # only runs if the event loop is not blocked
        return (await asyncio.wait_for(call, 30)).hashes

    stepping = threading.Thread(target=step)
    stepping.start()
    try:
        assert step_holds_lock.wait(10)
        assert asyncio.run(main()) == tuple(engine.block_pool.cached_hashes())
    finally:
        step_may_end.set()
        stepping.join(15)
        worker.loop.stop()
    assert ended_by_the_event_loop == [True]
