"""An in-process KV transfer server on 127.0.0.1, driven from synchronous tests
(hypothesis examples) through an event loop in a thread of its own."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import zlib
from collections.abc import Coroutine
from typing import Any

import grpc
import torch

from engine.block_pool import BlockPool, Holder
from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import GrpcKVServer, KVBlocks, PoolBlockStore, TransferConfig, wire
from kv_transfer.grpc_server import GRPC_OPTIONS, PUSH_METHOD
from protos.tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_grants import pull_grant, push_grant

LAYOUT = KVLayout("fp-fuzz", "float32", 2, 4, 1, 8)  # 256 bytes per block
CPU = torch.device("cpu")


def make_store(num_blocks: int = 32, seed: int = 0) -> PoolBlockStore:
    cache = KVCache(LAYOUT, num_blocks, CPU)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.layers:
        t.copy_(torch.rand(t.shape, generator=gen))
    return PoolBlockStore(BlockPool(num_blocks, LAYOUT.block_size), cache)


def block_tokens(num_blocks: int, seed: int = 0) -> list[int]:
    """Random token ids that fill ``num_blocks`` blocks."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (num_blocks * LAYOUT.block_size,), generator=gen).tolist()


def block_hashes(token_ids: list[int]) -> list[bytes]:
    """The hashes the receiver computes for them (empty salt)."""
    bs = LAYOUT.block_size
    return list(hash_blocks(token_ids, bs, root_hash(LAYOUT.model_fingerprint, bs)))


def header(request_id: str, num_blocks: int, **overrides: Any) -> pb.TransferHeader:
    """A push header; pass ``grant`` and ``token_ids`` for one the server admits."""
    fields: dict[str, Any] = {
        "layout": wire.layout_to_proto(LAYOUT),
        "request_id": request_id,
        "num_blocks": num_blocks,
        "total_bytes": num_blocks * LAYOUT.block_bytes,
    }
    fields.update(overrides)
    return pb.TransferHeader(**fields)


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` calls into it synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class KVServerHarness:
    """A GrpcKVServer over a small pool and a raw client channel to it."""

    def __init__(self, config: TransferConfig, num_blocks: int = 32) -> None:
        self.config = config
        self.thread = LoopThread()
        self.store = make_store(num_blocks)
        self.server = GrpcKVServer(self.store, config)
        self.thread.run(self.server.start())
        self.channel = self.thread.run(self._open())
        self.initial_free = self.store.num_free

    async def _open(self) -> grpc.aio.Channel:
        # No client-side limits: the server's must be what refuses oversized messages.
        unlimited = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            *GRPC_OPTIONS,
        ]
        return self.config.security.channel(self.server.address, unlimited)

    def push_grant(self, request_id: str) -> bytes:
        """The router's grant for a push of ``request_id`` here."""
        return push_grant(self.config, self.server.address, request_id)

    def blocks(self, request_id: str, block_ids: list[int]) -> KVBlocks:
        """A push of ``block_ids`` (tokens of their own) with its grant."""
        tokens = block_tokens(len(block_ids), zlib.crc32(request_id.encode()))
        blocks = KVBlocks(request_id, block_ids, [None] * len(block_ids), tokens)
        return dataclasses.replace(blocks, grant=self.push_grant(request_id))

    def pull_grant(self, request_id: str, hashes) -> bytes:
        return pull_grant(self.config, self.server.address, request_id, hashes)

    def raw_push(
        self,
        messages: list[bytes],
        metadata: tuple[tuple[str, str], ...] = (),
        timeout_s: float = 20,
    ) -> grpc.StatusCode:
        """Send ``messages`` as one PushBlocks call; the call's status."""
        return self.thread.run(self._raw_push(messages, metadata, timeout_s), timeout_s + 10)

    async def _raw_push(self, messages, metadata, timeout_s) -> grpc.StatusCode:
        call = self.channel.stream_unary(
            PUSH_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=pb.PushReply.FromString,
        )(timeout=timeout_s, metadata=tuple(metadata))
        try:
            for msg in messages:
                if call.done():
                    break
                await call.write(msg)
            await call.done_writing()
            reply = await call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return await call.code()
        # Committed: what a decode worker would claim, released here.
        held = self.server.claim(reply.request_id)
        if held is not None:
            self.store.release(held.holder, held.block_ids)
        return grpc.StatusCode.OK

    def settle(self, timeout_s: float = 15) -> tuple[list[Holder], int]:
        """(holders left, free block count) once every in-flight release has
        run: ([], initial_free) when nothing leaked."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.thread.run(self._state())
            if state == ([], self.initial_free):
                return state
            time.sleep(0.02)
        return self.thread.run(self._state())

    async def _state(self) -> tuple[list[Holder], int]:
        self.store.pool.verify()
        return self.store.holders(), self.store.num_free

    def close(self) -> None:
        try:
            self.thread.run(self.channel.close())
            self.thread.run(self.server.stop(0))
        finally:
            self.thread.close()
