"""A prefill worker that streams its KV while the prompt is computed
(``transfer.stream``): greedy outputs equal the whole-prompt push's and the
engine alone's, token for token, for prompts of several prefill chunks,
with prefix hits on either side and for a resumed request; the KV leaves
before the prefill is done; a push abandoned half-way leaves both pools as
they were."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import ClassVar

import pytest

import prefill_pool.worker as prefill_worker
from engine import LLM, EngineConfig, SamplingParams
from kv_transfer import GrpcKVClient, TransferConfig
from kv_transfer.feed import KVFeed
from prefill_pool.push import push_feed
from prefill_pool.worker import PrefillWorker
from protocol.requests import PrefillRequest
from tests.kv_grants import push_grant
from tests.unit.test_decode_start import ROUTER
from tests.unit.test_decode_start import pair as worker_pair

pytestmark = pytest.mark.unit

TRANSFER = TransferConfig(chunk_bytes=4096)
BUDGET = 32  # max_num_batched_tokens: a prompt of 150 tokens takes 5 prefill steps
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _config(llama_dir) -> EngineConfig:
    return EngineConfig(model=str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=BUDGET)


def pair(llama_dir, stream: bool, prefill_cls=PrefillWorker):
    transfer = dataclasses.replace(TRANSFER, stream_push=stream)
    return worker_pair(llama_dir, _config(llama_dir), transfer, prefill_cls)


def request(rid, prompt, d, outputs=(), params=GREEDY) -> PrefillRequest:
    grant = push_grant(d.transfer, d.kv_server.address, rid)
    return PrefillRequest(
        rid, ROUTER, prompt, params, d.kv_server.address, output_token_ids=list(outputs),
        push_grant=grant,
    )  # fmt: skip


def _prompt(n: int, start: int = 10) -> list[int]:
    return [start + (i * 37) % 900 for i in range(n)]


PROMPTS = [_prompt(7), _prompt(40), _prompt(150), _prompt(150)[:100] + _prompt(60, 500)]


async def _serve(p, d, rid, prompt, outputs=()):
    result = await p.prefill(request(rid, prompt, d, outputs))
    frames = await d.outputs.finished(rid)
    return result, list(outputs) + [t for f in frames for t in f.new_token_ids]


def test_streamed_and_whole_prompt_pushes_equal_the_engine_alone(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]

    async def run(stream: bool):
        got, sent = [], []
        async with pair(llama_dir, stream) as (p, d):
            for i, prompt in enumerate(PROMPTS):  # the last shares 100 tokens with the third
                result, tokens = await _serve(p, d, f"r{i}", prompt)
                got.append(tokens)
                sent.append((result.kv_bytes, result.held_blocks))
            # A resumed request: the tokens streamed before a failover are pushed too.
            result, tokens = await _serve(p, d, "resumed", PROMPTS[2], expected[2][:3])
            got.append(tokens)
        return got, sent

    streamed, streamed_sent = asyncio.run(run(True))
    whole, whole_sent = asyncio.run(run(False))
    assert streamed[:-1] == whole[:-1] == expected
    assert streamed[-1] == whole[-1] == expected[2]
    assert streamed_sent == whole_sent  # the same blocks moved, the same ones skipped
    assert streamed_sent[3][1] > 0  # the decode worker held the shared prefix


class GatedFeed(KVFeed):
    """Holds the engine thread at the first layer of the prefill's second step
    (its forward pass, the engine lock let go) until a chunk has left and
    ``release`` is set, so the KV of the first step must go out before the
    prefill is done."""

    chunk_out = threading.Event()
    release = threading.Event()
    gated: ClassVar[list[bool]] = []

    def progress(self, block_ids, computed_before, computed, layers) -> None:
        super().progress(block_ids, computed_before, computed, layers)
        if layers == 1 and computed_before > 0 and not self.gated:
            self.gated.append(self.chunk_out.wait(timeout=60) and self.release.wait(timeout=60))


@pytest.fixture
def gated(monkeypatch):
    """Prefill workers' feeds are GatedFeeds (``release`` set: only the chunk gates)."""

    def gated_feed(req, source, lock, max_model_len):
        feed = push_feed(req, source, lock, max_model_len)
        return GatedFeed(source, lock, feed.holder, feed.num_tokens)

    monkeypatch.setattr(prefill_worker, "push_feed", gated_feed)
    GatedFeed.chunk_out.clear()
    GatedFeed.release.set()
    GatedFeed.gated.clear()
    return GatedFeed


class GatedPrefill(PrefillWorker):
    async def _push(self, address, header, feed):
        count = 0

        def seen(msg: bytes) -> bytes:
            nonlocal count
            count += 1
            if count == 2:  # the header, then a chunk
                GatedFeed.chunk_out.set()
            return msg

        client = GrpcKVClient(self.transfer_config, message_filter=seen)
        try:
            return await client.stream(address, header, feed)
        finally:
            await client.close()


def test_the_kv_leaves_while_the_prompt_is_computed(llama_dir, gated):
    expected = LLM(str(llama_dir), num_kv_blocks=64).generate([PROMPTS[2]], GREEDY)[0].token_ids

    async def run():
        async with pair(llama_dir, True, GatedPrefill) as (p, d):
            _, tokens = await _serve(p, d, "gated", PROMPTS[2])
            return tokens

    assert asyncio.run(run()) == expected
    assert gated.gated == [True]  # a chunk left before the prefill's second step


def test_a_prefill_cancelled_half_way_through_its_push_frees_both_pools(llama_dir, gated):
    """The prefill's call goes away (as when its router gives up on the try)
    mid-prompt, after its push has sent KV: the engine request, the sender's
    pins and the receiver's reservation are all released; a retry completes."""
    expected = LLM(str(llama_dir), num_kv_blocks=64).generate([PROMPTS[2]], GREEDY)[0].token_ids
    gated.release.clear()

    async def run():
        async with pair(llama_dir, True, GatedPrefill) as (p, d):
            task = asyncio.ensure_future(p.prefill(request("doomed", PROMPTS[2], d)))
            await asyncio.to_thread(gated.chunk_out.wait, 60)
            assert d.engine.block_pool.num_free < d.initial_free_blocks  # reserved there
            task.cancel()
            await asyncio.sleep(0.1)
            gated.release.set()  # the engine goes on, and takes the abort
            await asyncio.wait([task])
            assert task.cancelled()
            async with asyncio.timeout(60):  # the receiver sees the call end
                while d.engine.block_pool.num_free != d.initial_free_blocks:
                    await asyncio.sleep(0.02)
            _, tokens = await _serve(p, d, "retry", PROMPTS[2])
            return tokens

    assert asyncio.run(run()) == expected


def test_a_cancel_that_lands_just_after_the_request_was_added_leaves_no_pin(llama_dir):
    """The prefill's call is cancelled while it waits for the engine to take
    the request, after the engine took it and stepped, so the push's feed
    pinned blocks before any push opened: every pin goes, nothing is left."""

    async def run():
        async with pair(llama_dir, True) as (p, d):
            acall = p.loop.acall

            async def add_then_cancel(fn):
                result = await acall(fn)
                if p.loop.acall is add_then_cancel:  # the add: cancel once it pinned
                    p.loop.acall = acall
                    async with asyncio.timeout(60):
                        while not any(h.id.startswith("send:cut") for h in p.store.holders()):
                            await asyncio.sleep(0.01)
                    raise asyncio.CancelledError
                return result

            p.loop.acall = add_then_cancel
            with pytest.raises(asyncio.CancelledError):
                await p.prefill(request("cut", PROMPTS[2], d))

    asyncio.run(run())
