"""The gRPC KV transfer client: push to, and pull from, a GrpcKVServer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
from collections.abc import Callable, Sequence

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
from .feed import Final, KVFeed, Span
from .grpc_server import HELD_BLOCKS_KEY, PULL_METHOD, PUSH_METHOD, grpc_options
from .interface import (
    BlockSink,
    KVTransferClient,
    PullResult,
    PushHeader,
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

    async def stream(
        self,
        address: str,
        header: PushHeader,
        feed: KVFeed,
        *,
        timeout_s: float | None = None,
    ) -> PushResult:
        try:
            await feed.wait_started()  # a queued prefill holds no slot, and no block there
            if self._push_slots is None:  # made here: it belongs to the running loop
                self._push_slots = asyncio.Semaphore(self.config.max_concurrent_pushes)
            async with self._push_slots:
                return await self._stream(address, KVSender(feed, header, self.config.chunk_bytes),
                                          timeout_s or self.config.timeout_s)  # fmt: skip
        finally:
            feed.close()

    async def _stream(self, address: str, sender: KVSender, timeout: float) -> PushResult:
        """Header, chunks as the feed has them, commit; ``timeout``: at most
        this long without progress (the call itself has no deadline: a push
        lasts as long as the prefill it streams)."""
        token = secrets.token_bytes(TOKEN_BYTES) if self.config.data_channel else None
        metadata: tuple[tuple[str, str], ...] = ()
        if token is not None:
            metadata = ((DATA_TOKEN_KEY, token.hex()),)
        call = self._channel(address).stream_unary(
            PUSH_METHOD,
            request_serializer=_identity,
            response_deserializer=pb.PushReply.FromString,
        )(metadata=metadata)
        mover = _Mover(self, call, sender, timeout)
        try:
            async with asyncio.timeout(timeout) as clock:
                mover.clock = clock
                await self._write(call, wire.encode_header(sender.header()))
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
                    mover.data = DataSender(
                        split_address(address),
                        int(port),
                        token,
                        sender,
                        timeout,
                        self._filter,
                        self.config.security,
                    )
                final = await mover.run()
                if final is not None:
                    await self._write(call, sender.commit_message(final))
                await call.done_writing()
                reply = await call
        except TimeoutError as e:
            raise TransferError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"push made no progress for {timeout:g} s"
            ) from e
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            # A write that fails because the server ended the call reports a
            # generic error; the call's own status says why.
            code, details = await call.code(), await call.details()
            raise transfer_error(code, details or "") from e
        finally:
            await mover.stop()
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


class _Mover:
    """Moves one push's chunks as its feed has them: over the data connection
    (``data``), else as gRPC messages; each thread job runs in the client's
    executor, one at a time, and every job and report pushes the deadline on."""

    def __init__(self, client: GrpcKVClient, call, sender: KVSender, timeout: float) -> None:
        self.client, self.call, self.sender, self.timeout = client, call, sender, timeout
        self.data: DataSender | None = None
        self.clock: asyncio.Timeout | None = None
        self._pending: asyncio.Future | None = None  # the thread's job in flight

    async def run(self) -> Final | None:
        """Every chunk; the final, or None when the data connection broke after
        it was made (the call's status then says why)."""
        try:
            if self.data is not None:
                await self._job(self.data.open)
            while True:
                spans, final = self.sender.take()
                self._progress()
                if spans:
                    await self._send(spans)
                if final is not None:
                    if self.data is not None:
                        await self._job(self.data.end)
                    return final
                self._progress(None)  # waiting for the prefill is no stalled transfer
                await self.sender.feed.changed()
        except OSError as e:
            if self.data is None or not self.data.connected:
                raise TransferError(
                    grpc.StatusCode.UNAVAILABLE, f"data connection refused: {e}"
                ) from e
            return None  # the server dropped the connection: the call's status says why

    async def _send(self, spans: list[Span]) -> None:
        if self.data is not None:
            await self._job(self.data.send, spans)
            return
        for span in spans:
            msg = await self._job(self._chunk, span)
            if msg is not None:
                await self.call.write(msg)
            self._progress()

    def _chunk(self, span: Span) -> bytes | None:
        """A chunk message through the client's filter (in the executor)."""
        msg = self.sender.chunk_message(span)
        return msg if self.client._filter is None else self.client._filter(msg)

    async def _job(self, fn, *args):
        loop = asyncio.get_running_loop()
        self._pending = loop.run_in_executor(self.client._executor, fn, *args)
        await asyncio.wait([self._pending])  # shielded: stop() ends it
        result = self._pending.result()
        self._progress()
        return result

    def _progress(self, timeout: float | None = -1.0) -> None:
        """Made progress: the deadline is ``timeout`` (the mover's by default;
        None: none) from now."""
        if self.clock is not None:
            timeout = self.timeout if timeout == -1.0 else timeout
            now = asyncio.get_running_loop().time()
            self.clock.reschedule(None if timeout is None else now + timeout)

    async def stop(self) -> None:
        """End the job in flight (it reads pinned blocks) and the connection."""
        pending = self._pending
        if pending is not None and not pending.done():
            if self.data is not None:
                self.data.abort()
            await asyncio.wait([pending])
        if pending is not None and pending.done() and not pending.cancelled():
            pending.exception()  # already failing, or read: its error is not the news
        if self.data is not None:
            self.data.close()


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
