"""An in-process KV mover for the unit tests: the same messages, sender,
receiver, service and leases as gRPC (kv_transfer/), handed over by function
call, so the transport-independent logic is tested without a network.

It is also the shortest example of a mover over ``KVTransferService``
(``open_push``/``open_pull``): a same-host mover (shared memory) that skips
the network would start from it and from kv_transfer/grpc_server.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from engine.block_pool import Held
from kv_transfer import wire
from kv_transfer.feed import KVFeed
from kv_transfer.grpc_client import MessageFilter
from kv_transfer.interface import (
    BlockSink,
    KVTransferClient,
    KVTransferServer,
    PullResult,
    PushHandler,
    PushHeader,
    PushResult,
    TransferConfig,
    TransferError,
    TransferState,
)
from kv_transfer.pool_store import PoolBlockStore
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.service import KVTransferService
from protos.tandem.v1 import kv_transfer_pb2 as pb


class InProcHub:
    """Address book of in-process servers (one per test, not module state)."""

    def __init__(self) -> None:
        self.services: dict[str, KVTransferService] = {}

    def lookup(self, address: str) -> KVTransferService:
        service = self.services.get(address)
        if service is None:
            raise TransferError(grpc.StatusCode.UNAVAILABLE, f"no server at {address}")
        return service


class InProcKVServer(KVTransferServer):
    def __init__(
        self,
        hub: InProcHub,
        name: str,
        store: PoolBlockStore,
        config: TransferConfig | None = None,
        handler: PushHandler | None = None,
    ) -> None:
        self.hub = hub
        self.address = f"inproc:{name}"
        self.service = KVTransferService(store, config, handler=handler, identity=self.address)

    async def start(self) -> None:
        self.hub.services[self.address] = self.service
        self.service.start_reaper()

    async def stop(self, grace_s: float | None = None) -> None:
        self.hub.services.pop(self.address, None)
        await self.service.close()

    def claim(self, request_id: str) -> Held | None:
        return self.service.claim(request_id)

    def discard(self, request_id: str) -> None:
        self.service.discard(request_id)


class _Cancelled:
    def __init__(self) -> None:
        self.set = False

    def __call__(self) -> None:
        self.set = True

    async def check(self) -> None:
        await asyncio.sleep(0)  # let the lease reaper run between messages
        if self.set:
            raise TransferError(grpc.StatusCode.CANCELLED, "lease expired")


class _Push:
    """One push into a service's IncomingPush, message by message."""

    def __init__(self, service: KVTransferService, message_filter: MessageFilter | None) -> None:
        self.cancelled = _Cancelled()
        self.incoming = service.open_push(self.cancelled)
        self._filter = message_filter
        self.reply: pb.PushReply | None = None

    async def send(self, msg: bytes) -> None:
        await self.cancelled.check()  # a stream that waited may have lost its lease
        out = msg if self._filter is None else self._filter(msg)
        if out is not None:
            self.reply = self.incoming.on_message(wire.decode(out))
        await self.cancelled.check()


class InProcKVClient(KVTransferClient):
    def __init__(
        self,
        hub: InProcHub,
        config: TransferConfig | None = None,
        message_filter: MessageFilter | None = None,
    ) -> None:
        self.hub = hub
        self.config = config or TransferConfig()
        self._filter = message_filter

    async def stream(
        self,
        address: str,
        header: PushHeader,
        feed: KVFeed,
        *,
        timeout_s: float | None = None,
    ) -> PushResult:
        try:
            await feed.wait_started()
            service = self.hub.lookup(address)
            sender = KVSender(feed, header, self.config.chunk_bytes)
            push = _Push(service, self._filter)
            try:
                async with asyncio.timeout(timeout_s or self.config.timeout_s):
                    await push.send(wire.encode_header(sender.header()))
                    if push.incoming.state is TransferState.TRANSFERRING:
                        sender.skip(push.incoming.receiver.held_blocks)  # before the first chunk
                    while True:
                        spans, final = sender.take()
                        for span in spans:
                            await push.send(sender.chunk_message(span))
                        if final is not None:
                            await push.send(sender.commit_message(final))
                            break
                        await feed.changed()
            except TimeoutError as e:
                raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "push timed out") from e
            finally:
                push.incoming.close()
                sender.close(succeeded=push.reply is not None)
        finally:
            feed.close()
        if push.reply is None:
            raise TransferError(grpc.StatusCode.ABORTED, "stream ended before commit")
        reply = push.reply
        return PushResult(
            reply.request_id, list(reply.block_ids), sender.bytes_sent, sender.skipped
        )

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
        service = self.hub.lookup(address)
        request = pb.PullRequest(
            layout=wire.layout_to_proto(sink.layout),
            request_id=request_id,
            block_hashes=block_hashes,
            grant=grant,
        )
        cancelled = _Cancelled()
        pull = service.open_pull(request, cancelled)
        receiver = KVReceiver(sink, asked=list(block_hashes), asked_tokens=token_ids)
        try:
            async with asyncio.timeout(timeout_s or self.config.timeout_s):
                for msg in pull.messages():
                    receiver.on_message(wire.decode(msg))
                    await cancelled.check()
            held = receiver.commit()
        except TimeoutError as e:
            raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "pull timed out") from e
        finally:
            pull.close(receiver.state is TransferState.SUCCEEDED)
            receiver.fail()
        return PullResult(
            held.block_ids, receiver.block_hashes, receiver.bytes_received, held.holder
        )
