"""The gRPC KV transfer client: push to, and pull from, a GrpcKVServer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

import grpc

from net.sockets import split_address
from protos.tandem.v1 import kv_transfer_pb2 as pb

from . import wire
from .datachannel import (
    DATA_PORT_KEY,
    DATA_TOKEN_KEY,
    PUSH_REFUSED_KEY,
    TOKEN_BYTES,
    DataSender,
)
from .grpc_server import HELD_BLOCKS_KEY, PULL_METHOD, PUSH_METHOD, grpc_options
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
    transfer_error,
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
        or drop it (None): a hook for whoever builds the client (the workers
        set none; tests/faults.py breaks pushes with it)."""
        self.config = config or TransferConfig()
        self._filter = message_filter
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._push_slots: asyncio.Semaphore | None = None
        # Gathers the next chunk, and copies a pulled one, while gRPC moves
        # the previous (torch copies and zlib release the GIL).
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-client")

    async def push(
        self, address: str, source: BlockSource, blocks: KVBlocks, *, timeout_s: float | None = None
    ) -> PushResult:
        if self._push_slots is None:  # made here: it belongs to the running loop
            self._push_slots = asyncio.Semaphore(self.config.max_concurrent_pushes)
        async with self._push_slots:
            return await self._push(address, source, blocks, timeout_s)

    async def _push(
        self, address: str, source: BlockSource, blocks: KVBlocks, timeout_s: float | None
    ) -> PushResult:
        timeout = timeout_s or self.config.timeout_s
        token = secrets.token_bytes(TOKEN_BYTES) if self.config.data_channel else None
        metadata: tuple[tuple[str, str], ...] = ()
        if token is not None:
            metadata = ((DATA_TOKEN_KEY, token.hex()),)
        call = self._channel(address).stream_unary(
            PUSH_METHOD,
            request_serializer=_identity,
            response_deserializer=pb.PushReply.FromString,
        )(timeout=timeout, metadata=metadata)
        try:  # the blocks are pinned from here until sender.close() below
            sender = KVSender.push(source, blocks, self.config.chunk_bytes)
        except BaseException:
            call.cancel()
            raise
        loop = asyncio.get_running_loop()
        messages = sender.messages()
        pending: asyncio.Future | None = None  # the worker thread's job in flight
        data: DataSender | None = None
        try:
            await self._write(call, next(messages))  # the header
            # The server answers the header with initial metadata once it has
            # checked the layout and reserved the blocks; no chunk is sent
            # before (a refused push fails here, with the server's status).
            metadata = await call.initial_metadata()
            if call.done() or _metadata_value(metadata, PUSH_REFUSED_KEY) is not None:
                await call.done_writing()
                await call  # refused: raises with the server's status
            _skip_held(sender, metadata)
            port = _metadata_value(metadata, DATA_PORT_KEY)
            if token is not None and port is not None:
                data = DataSender(
                    split_address(address),
                    int(port),
                    token,
                    sender,
                    timeout,
                    self._filter,
                    self.config.security,
                )
                pending = loop.run_in_executor(self._executor, data.run)
                try:
                    await asyncio.wait([pending])  # shielded: finally stops it
                    pending.result()
                except OSError as e:
                    if not data.connected:
                        raise TransferError(
                            grpc.StatusCode.UNAVAILABLE, f"data connection refused: {e}"
                        ) from e
                    # The server dropped the connection: the call's status says why.
                else:
                    await self._write(call, wire.encode_commit())
            else:
                messages = chain(messages, [wire.encode_commit()])
                pending = loop.run_in_executor(self._executor, self._next, messages)
                while (msg := await pending) is not None:
                    pending = loop.run_in_executor(self._executor, self._next, messages)
                    await call.write(msg)
            await call.done_writing()
            reply = await call
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            # A write that fails because the server ended the call reports a
            # generic error; the call's own status says why.
            code, details = await call.code(), await call.details()
            raise transfer_error(code, details or "") from e
        finally:
            if pending is not None and not pending.done():
                if data is not None:
                    data.abort()
                await asyncio.wait([pending])  # the thread reads pinned blocks
                if not pending.cancelled():
                    pending.exception()  # already failing: its error is not the news
            sender.close(succeeded=call.done() and not call.cancelled())
            if not call.done():
                call.cancel()
        return PushResult(
            reply.request_id, list(reply.block_ids), sender.bytes_sent, sender.skipped
        )

    async def _write(self, call, msg: bytes) -> None:
        out = msg if self._filter is None else self._filter(msg)
        if out is not None:
            await call.write(out)

    def _next(self, messages: Iterator[bytes]) -> bytes | None:
        """The next message that passes the filter, or None at the end."""
        for msg in messages:
            out = msg if self._filter is None else self._filter(msg)
            if out is not None:
                return out
        return None

    async def pull(
        self,
        address: str,
        sink: BlockSink,
        block_hashes: Sequence[bytes],
        *,
        request_id: str = "",
        grant: bytes = b"",
        token_ids: Sequence[int] = (),
        timeout_s: float | None = None,
    ) -> PullResult:
        request = pb.PullRequest(
            layout=wire.layout_to_proto(sink.layout),
            request_id=request_id,
            block_hashes=block_hashes,
            grant=grant,
        )
        call = self._channel(address).unary_stream(
            PULL_METHOD,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=wire.decode,
        )(
            request,
            timeout=timeout_s or self.config.timeout_s,
        )
        receiver = KVReceiver(sink, asked=list(block_hashes), asked_tokens=token_ids)
        try:
            async for msg in call:
                await receiver.on_message_async(msg, self._executor)
            await receiver.drain()
            if receiver.state is TransferState.PENDING:
                raise TransferError(grpc.StatusCode.INTERNAL, "pull stream without header")
            held = receiver.commit()
        except grpc.aio.AioRpcError as e:
            raise TransferError(e.code(), e.details() or "") from e
        finally:
            receiver.fail()
            if not call.done():
                call.cancel()
        return PullResult(
            held.block_ids, receiver.block_hashes, receiver.bytes_received, held.holder
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._executor.shutdown(wait=True)

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.config.security.channel(address, grpc_options(self.config))
            self._channels[address] = channel
        return channel


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def _skip_held(sender: KVSender, metadata) -> None:
    """Send only the blocks the receiver does not hold already."""
    try:
        sender.skip(int(_metadata_value(metadata, HELD_BLOCKS_KEY) or 0))
    except ValueError as exc:  # a receiver that answered nonsense
        raise TransferError(grpc.StatusCode.INTERNAL, f"bad held-blocks answer: {exc}") from None
