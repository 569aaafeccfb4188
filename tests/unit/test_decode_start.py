"""The request path without Ray: a prefill worker pushes a request to a
decode worker, which starts it when the push commits and sends every token,
the first included, on the router's output stream; the prefill worker's
cache events reach the router on its own output stream. The push sends only the
blocks the decode worker lacks; pushes for aborted requests or for a router
with no stream are refused; every request leaves both pools as it found
them."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from decode_pool.worker import DecodeWorker
from engine import LLM, EngineConfig, SamplingParams
from kv_transfer import TransferConfig, TransferError
from prefill_pool.worker import PrefillWorker
from protocol.requests import DecodeRequest, PrefillRequest
from router.pool_manager import WorkerHandle
from router.worker_streams import WorkerStreams
from tests.kv_grants import push_grant
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

ROUTER = "router-a"
TRANSFER = TransferConfig()  # one cluster secret for the workers and the router


class Outputs:
    """A decode worker's output streams, with one router subscribed."""

    def __init__(self) -> None:
        self.frames: dict[str, list] = {}
        self._owner: dict[str, str] = {}

    def has_router(self, router_id: str) -> bool:
        return router_id == ROUTER

    def own(self, request_id: str, router_id: str) -> bool:
        if not self.has_router(router_id):
            return False
        self._owner[request_id] = router_id
        return True

    def disown(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def publish(self, outputs, events, room=None) -> None:
        for out in outputs:
            if out.request_id in self._owner:
                self.frames.setdefault(out.request_id, []).append(out)

    def close(self) -> None:
        pass

    async def finished(self, request_id: str) -> list:
        while not any(o.finished for o in self.frames.get(request_id, [])):
            await asyncio.sleep(0.01)
        return self.frames[request_id]


@contextlib.asynccontextmanager
async def pair(llama_dir, config=None, transfer=TRANSFER, prefill_cls=PrefillWorker):
    """A prefill and a decode worker (``config`` default: the tiny model, 48
    blocks); at the end, no request and no block holder left on either."""
    config = config or EngineConfig(model=str(llama_dir), num_kv_blocks=48)
    p, d = prefill_cls("p", config, transfer), DecodeWorker("d", config, transfer)
    await p.start()
    d.start_loop()
    await d.kv_server.start()
    d.outputs = Outputs()
    free = (p.engine.block_pool.num_free, d.engine.block_pool.num_free)
    try:
        yield p, d
        for w in (p, d):  # no request left running, no block holder left
            assert await w.loop.acall(lambda e: e.request_ids()) == []
            assert leftover_holders(w.engine.block_pool) == []
        assert (p.engine.block_pool.num_free, d.engine.block_pool.num_free) == free
    finally:
        await p.stop()
        await d.kv_server.stop(0)
        d.stop_loop()


def prefill_request(rid, prompt, params, d, router=ROUTER) -> PrefillRequest:
    grant = push_grant(d.transfer, d.kv_server.address, rid)  # as the router mints it
    return PrefillRequest(rid, router, prompt, params, d.kv_server.address, push_grant=grant)


def reference(llama_dir, prompt, params) -> list[int]:
    return LLM(str(llama_dir), num_kv_blocks=48).generate([prompt], params)[0].token_ids


def test_the_push_starts_the_request_and_its_first_token_leads_the_stream(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = list(range(10, 50))
    expected = reference(llama_dir, prompt, params)

    async def run():
        async with pair(llama_dir) as (p, d):
            result = await p.prefill(prefill_request("r", prompt, params, d))
            frames = await d.outputs.finished("r")
            assert not result.aborted and result.kv_bytes > 0 and result.held_blocks == 0
            assert frames[0].new_token_ids == expected[:1]
            assert frames[0].num_output_tokens == 1 and frames[0].num_prompt_tokens == len(prompt)
            assert [t for f in frames for t in f.new_token_ids] == expected
            assert frames[-1].finish_reason == "length"

    asyncio.run(run())


def test_a_decode_worker_holding_the_prefix_is_sent_only_the_rest(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = list(range(10, 60))
    second = first + list(range(200, 210))
    expected = reference(llama_dir, second, params)

    async def run():
        async with pair(llama_dir) as (p, d):
            bs = d.engine.config.block_size
            one = await p.prefill(prefill_request("one", first, params, d))
            await d.outputs.finished("one")
            two = await p.prefill(prefill_request("two", second, params, d))
            frames = await d.outputs.finished("two")
            # The decode worker cached the first prompt's full blocks.
            assert two.held_blocks == len(first) // bs
            assert two.kv_bytes < one.kv_bytes
            assert [t for f in frames for t in f.new_token_ids] == expected

    asyncio.run(run())


def test_a_request_its_first_token_ends_is_one_finished_frame(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=1)
    prompt = list(range(10, 30))
    expected = reference(llama_dir, prompt, params)

    async def run():
        async with pair(llama_dir) as (p, d):
            result = await p.prefill(prefill_request("r", prompt, params, d))
            [frame] = await d.outputs.finished("r")
            assert result.kv_bytes == 0  # no block moves
            assert (frame.new_token_ids, frame.finish_reason) == (expected, "length")

    asyncio.run(run())


def test_pushes_for_an_aborted_request_or_a_router_without_a_stream_are_refused(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(10, 40))

    async def run():
        async with pair(llama_dir) as (p, d):
            await d.abort("late")  # the router gave up on this try before its push
            with pytest.raises(TransferError) as late:
                await p.prefill(prefill_request("late", prompt, params, d))
            with pytest.raises(TransferError) as stranger:
                await p.prefill(prefill_request("x", prompt, params, d, router="router-b"))
            with pytest.raises(LookupError, match="aborted"):
                await d.start_full(DecodeRequest("late", ROUTER, prompt, [], params))
            assert late.value.code == grpc.StatusCode.CANCELLED
            assert stranger.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert d.outputs.frames == {}

    asyncio.run(run())


@contextlib.asynccontextmanager
async def prefill_stream(p: PrefillWorker):
    """A router's reader of ``p``'s output stream: (handle, events it brought)."""
    events: list = []
    streams = WorkerStreams(ROUTER, events.extend, lambda w, why: None, TRANSFER)
    handle = WorkerHandle(p.name, "prefill", None, p.describe())
    await streams.subscribe(handle)
    try:
        yield streams, handle, events
    finally:
        await streams.close()


def test_a_prefill_workers_cache_events_reach_the_router_on_its_stream(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(10, 60))

    async def run():
        async with pair(llama_dir) as (p, d), prefill_stream(p) as (streams, handle, events):
            result = await p.prefill(prefill_request("r", prompt, params, d))
            await d.outputs.finished("r")
            assert result.events_seq >= 1
            await asyncio.wait_for(streams.caught_up(handle, result.events_seq), 10)
            # Every full block of the prompt, which stays in P's prefix cache.
            cached = set(p.cached_hashes())
            assert len(cached) == len(prompt) // p.engine.config.block_size
            assert cached <= {h for e in events for h in e.stored}
            assert {e.worker for e in events} == {"p"}

    asyncio.run(run())


class Collected:
    """An index elsewhere (Redis): the worker's events go to it alone."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def test_with_the_index_elsewhere_a_prefill_stream_carries_no_events(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(10, 60))

    async def run():
        async with pair(llama_dir) as (p, d), prefill_stream(p) as (streams, handle, events):
            p.publisher = elsewhere = Collected()
            result = await p.prefill(prefill_request("r", prompt, params, d))
            await d.outputs.finished("r")
            assert result.events_seq == 0 and p.outputs.events_seq == 0
            assert {h for e in elsewhere.events for h in e.stored} >= set(p.cached_hashes())
            await streams.caught_up(handle, result.events_seq)
            assert events == []

    asyncio.run(run())
