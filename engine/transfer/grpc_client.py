"""The gRPC KV transfer client: push to, and pull from, a GrpcKVServer."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

import grpc

from protos.tandem.v1 import kv_transfer_pb2 as pb

from . import wire
from .grpc_server import GRPC_OPTIONS, PULL_METHOD, PUSH_METHOD
from .interface import (
    BlockSink,
    BlockSource,
    KVBlocks,
    KVTransferClient,
    PullResult,
    PushResult,
    TransferConfig,
    TransferError,
    TransferState,
)
from .receiver import KVReceiver
from .sender import KVSender

MessageFilter = Callable[[bytes], bytes | None]


def _identity(data: bytes) -> bytes:
    return data


class GrpcKVClient(KVTransferClient):
    def __init__(
        self, config: TransferConfig | None = None, message_filter: MessageFilter | None = None
    ) -> None:
        """``message_filter`` sees every outgoing push message and may change
        or drop it (None); it exists for fault-injection tests."""
        self.config = config or TransferConfig()
        self._filter = message_filter
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Gathers the next chunk, and copies a pulled one, while gRPC moves
        # the previous (torch copies and zlib release the GIL).
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-client")

    async def push(
        self, address: str, source: BlockSource, blocks: KVBlocks, *, timeout_s: float | None = None
    ) -> PushResult:
        source.pin(blocks.block_ids)
        sender = KVSender(
            source,
            blocks.request_id,
            blocks.block_ids,
            blocks.block_hashes,
            blocks.token_ids,
            self.config.chunk_bytes,
        )
        call = self._channel(address).stream_unary(
            PUSH_METHOD,
            request_serializer=_identity,
            response_deserializer=pb.PushReply.FromString,
        )(timeout=timeout_s or self.config.timeout_s)
        loop = asyncio.get_running_loop()
        messages = self._filtered(chain(sender.messages(), [wire.encode_commit()]))
        next_msg = loop.run_in_executor(self._executor, next, messages, None)
        try:
            while (msg := await next_msg) is not None:
                next_msg = loop.run_in_executor(self._executor, next, messages, None)
                await call.write(msg)
            await call.done_writing()
            reply = await call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            # A write that fails because the server ended the call reports a
            # generic error; the call's own status says why.
            code, details = await call.code(), await call.details()
            raise TransferError(code, details or "") from e
        finally:
            if not next_msg.done():
                await asyncio.wait([next_msg])  # the gather reads pinned blocks
            sender.close(succeeded=call.done() and not call.cancelled())
            if not call.done():
                call.cancel()
        return PushResult(reply.request_id, list(reply.block_ids), sender.bytes_sent)

    async def pull(
        self,
        address: str,
        sink: BlockSink,
        block_hashes: Sequence[bytes],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> PullResult:
        request = pb.PullRequest(
            layout=wire.layout_to_proto(sink.layout),
            request_id=request_id,
            block_hashes=block_hashes,
        )
        call = self._channel(address).unary_stream(
            PULL_METHOD,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=wire.decode,
        )(request, timeout=timeout_s or self.config.timeout_s)
        receiver = KVReceiver(sink)
        try:
            async for msg in call:
                await receiver.on_message_async(msg, self._executor)
            await receiver.drain()
            if receiver.state is TransferState.PENDING:
                raise TransferError(grpc.StatusCode.INTERNAL, "pull stream without header")
            block_ids = receiver.commit()
        except grpc.aio.AioRpcError as e:
            raise TransferError(e.code(), e.details() or "") from e
        finally:
            receiver.fail()
            if not call.done():
                call.cancel()
        return PullResult(block_ids, receiver.block_hashes, receiver.bytes_received)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=True)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = channel
        return channel

    def _filtered(self, messages: Iterator[bytes]) -> Iterator[bytes]:
        for msg in messages:
            out = msg if self._filter is None else self._filter(msg)
            if out is not None:
                yield out
