"""A decode worker refuses calls for a request it has aborted: a call that
arrives late (the router gave up on a hung try and aborted it) must not pin
or hold blocks nobody will free. A decode started before its KV waits for
the push."""

from __future__ import annotations

import asyncio

import pytest

from decode_pool.worker import DecodeRequest, DecodeWorker
from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.hashing import hash_blocks
from kv_transfer import GrpcKVClient, KVBlocks, PoolBlockStore, TransferConfig

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


class _Outputs:
    """The output streams of one subscribed router, kept in a list."""

    def __init__(self) -> None:
        self.outputs: list = []

    def has_router(self, router_id: str) -> bool:
        return router_id == "router"

    def own(self, request_id: str, router_id: str) -> None:
        pass

    def disown(self, request_id: str) -> None:
        pass

    def publish(self, outputs, events) -> None:
        self.outputs += outputs

    def close(self) -> None:
        pass


def test_a_decode_started_before_its_kv_waits_for_the_push(llama_dir):
    """The router starts the decode while the prefill runs: it begins when the
    push commits, from the token the push carries; an abort, or a push with
    no token, ends the wait with the pool as it was."""

    async def run():
        worker = DecodeWorker("d", EngineConfig(model=str(llama_dir), num_kv_blocks=32))
        worker.start_loop()
        await worker.kv_server.start()
        worker.outputs = outputs = _Outputs()
        sender = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=32))
        source = PoolBlockStore(sender.block_pool, sender.kv_cache)
        client = GrpcKVClient(TransferConfig())
        try:
            free = worker.engine.block_pool.num_free
            bs = worker.engine.config.block_size
            prompt = list(range(10, 10 + bs + 3))
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

            def request(rid: str) -> DecodeRequest:
                return DecodeRequest(rid, "router", prompt, [], params)

            async def push(rid: str, next_tokens: list[int]) -> None:
                sender.add_request(rid, prompt, params, True)
                first = sender.step()[0]
                export = sender.export_kv(rid, with_data=False)
                known = export.prompt_token_ids + export.output_token_ids
                blocks = KVBlocks(rid, export.block_ids, [None] * 2, known[:-1], next_tokens)
                assert next_tokens in ([], first.new_token_ids)
                await client.push(worker.kv_server.address, source, blocks)
                sender.abort(rid)

            aborted = asyncio.ensure_future(worker.start_decode(request("a")))
            await asyncio.sleep(0)  # it runs up to its wait for the push
            await worker.abort("a")
            with pytest.raises(LookupError, match="discarded"):  # the abort ended the wait
                await aborted
            assert worker.engine.block_pool.num_free == free

            tokenless = asyncio.ensure_future(worker.start_decode(request("t")))
            await push("t", [])
            with pytest.raises(LookupError, match="no sampled token"):
                await tokenless
            assert worker.engine.block_pool.num_free == free

            expected = LLM(str(llama_dir), num_kv_blocks=32).generate([prompt], params)[0].token_ids
            started = asyncio.ensure_future(worker.start_decode(request("ok")))
            await asyncio.sleep(0)  # waiting for the push before it begins
            await push("ok", expected[:1])
            await started
            while not any(o.finished for o in outputs.outputs):
                await asyncio.sleep(0.01)
            decoded = [t for o in outputs.outputs for t in o.new_token_ids]
            assert expected[:1] + decoded == expected
            assert worker.engine.block_pool.num_free == free
        finally:
            await client.close()
            await worker.kv_server.stop(0)
            worker.stop_loop()

    asyncio.run(run())
