"""A decode worker refuses calls for a request it has aborted: a call that
arrives late (the router gave up on a hung try and aborted it) must not pin
or hold blocks nobody will free."""

from __future__ import annotations

import asyncio

import pytest

from decode_pool.worker import DecodeRequest, DecodeWorker
from engine import EngineConfig, SamplingParams
from engine.hashing import hash_blocks

pytestmark = pytest.mark.unit


def test_calls_after_abort_are_refused(llama_dir):
    async def run():
        worker = DecodeWorker("d", EngineConfig(model=str(llama_dir), num_kv_blocks=32))
        worker.start_loop()
        try:
            bs = worker.engine.config.block_size
            tokens = list(range(10, 10 + 2 * bs))
            hashes = hash_blocks(tokens, bs, worker.engine.root_hash)

            def cache_two(engine):  # two cached blocks with no reference
                pool = engine.block_pool
                blocks = pool.allocate(2)
                for j, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
                    pool.cache(b, h, tokens[j * bs : (j + 1) * bs])
                pool.free(blocks)

            await worker.loop.acall(cache_two)
            free = worker.engine.block_pool.num_free
            assert await worker.reserve_prefix("live", hashes) == 2  # pins for a live request
            await worker.abort("live")
            await worker.abort("late")
            assert await worker.reserve_prefix("late", hashes) == 0
            req = DecodeRequest("late", "router", tokens, [5], SamplingParams(max_tokens=4))
            with pytest.raises(LookupError, match="aborted"):
                await worker.start_decode(req)
            with pytest.raises(LookupError, match="aborted"):
                await worker.start_full(req)
            assert worker.engine.block_pool.num_free == free
        finally:
            worker.stop_loop()

    asyncio.run(run())
