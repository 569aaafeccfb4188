"""The engine thread lets go of the pool lock while the model computes, so a
KV transfer's pool bookkeeping waits for a step's bookkeeping only."""

from __future__ import annotations

import threading

import pytest

from engine import EngineConfig, LLMEngine
from engine.block_pool import Holder
from engine.engine_loop import EngineLoop
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit


def test_the_pool_lock_is_free_during_the_forward_pass(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=32))
    in_forward, go_on = threading.Event(), threading.Event()
    forward = engine.model.forward

    def gated_forward(*args, **kwargs):
        in_forward.set()
        assert go_on.wait(10)
        return forward(*args, **kwargs)

    engine.model.forward = gated_forward
    outputs = []
    loop = EngineLoop(engine, outputs.extend)
    loop.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        loop.call(lambda e: e.add_request("r", [5, 6, 7], params)).result(10)
        assert in_forward.wait(10)
        # What a transfer does from its own thread while the step computes.
        assert loop.lock.acquire(timeout=5)
        try:
            lease = Holder("lease", "recv:t#0")
            assert engine.block_pool.allocate(lease, 2) is not None
            engine.block_pool.release(lease)
        finally:
            loop.lock.release()
        go_on.set()
        loop.call(lambda e: None).result(10)
        while loop.call(lambda e: e.has_unfinished()).result(10):
            pass
    finally:
        go_on.set()
        loop.stop()
    assert [o.num_output_tokens for o in outputs] == [1, 2]
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == 32
