"""The gRPC KV transfer server each worker runs (``tandem.v1.KVTransfer``).

Methods are registered as generic handlers with our own (de)serializers so
chunk payloads bypass the protobuf library (see wire.py); the bytes on the
wire are exactly the messages kv_transfer.proto defines. A push's chunks may
instead come over a raw TCP data connection the call negotiates
(datachannel.py); the call still carries header, commit and status.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib

import grpc

from engine.block_pool import Held
from protos.tandem.v1 import kv_transfer_pb2 as pb

from . import wire
from .datachannel import (
    DATA_PORT_KEY,
    DATA_TOKEN_KEY,
    PUSH_REFUSED_KEY,
    TOKEN_BYTES,
    DataServer,
    IncomingData,
)
from .interface import (
    KVTransferServer,
    PushHandler,
    TransferConfig,
    TransferError,
    TransferState,
)
from .pool_store import PoolBlockStore
from .service import IncomingPush, KVTransferService

SERVICE = "tandem.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/PushBlocks"
PULL_METHOD = f"/{SERVICE}/PullBlocks"
# Initial metadata of an accepted push: leading blocks the receiver holds already.
HELD_BLOCKS_KEY = "tandem-kv-held-blocks"

# Large HTTP/2 frames and flow-control windows, large socket reads: bulk KV
# moves at a multiple of gRPC's defaults (bench/kv_transfer.py).
GRPC_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.optimization_target", "throughput"),
    ("grpc.http2.max_frame_size", 8 << 20),
    ("grpc.http2.lookahead_bytes", 64 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def message_limits(config: TransferConfig) -> list[tuple[str, int | str]]:
    """The configured message size limit, both directions (every internal endpoint)."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]


def grpc_options(config: TransferConfig) -> list[tuple[str, int | str]]:
    """The KV transfer channel's options: message limits plus GRPC_OPTIONS;
    with a port range, no SO_REUSEPORT (else a second server would share a
    taken port instead of moving to the next)."""
    reuse = [("grpc.so_reuseport", 0)] if config.port_range is not None else []
    return [*message_limits(config), *GRPC_OPTIONS, *reuse]


def _identity(data: bytes) -> bytes:
    return data


class GrpcKVServer(KVTransferServer):
    def __init__(
        self,
        store: PoolBlockStore,
        config: TransferConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        handler: PushHandler | None = None,
    ) -> None:
        self.service = KVTransferService(store, config, handler=handler)
        self._bind = f"{host}:{port}"
        self._host = host
        self._server: grpc.aio.Server | None = None
        self._data: DataServer | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-recv")
        self.address = ""

    async def start(self) -> None:
        config = self.service.config
        auth = config.security.interceptor()  # bound to the address below
        server = grpc.aio.server(options=grpc_options(config), interceptors=[auth])
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "PushBlocks": grpc.stream_unary_rpc_method_handler(
                    self._push,
                    request_deserializer=wire.decode,
                    response_serializer=pb.PushReply.SerializeToString,
                ),
                "PullBlocks": grpc.unary_stream_rpc_method_handler(
                    self._pull,
                    request_deserializer=wire.decode_pull_request,
                    response_serializer=_identity,
                ),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = self._add_port(server, config)
        self.address = f"{self._host}:{port}"
        auth.bind(self.address)  # calls signed for another server are refused
        await server.start()
        self._server = server
        self.service.identity = self.address  # what the router's grants name
        if config.data_channel and (config.security.tls is None or config.tls_data_channel):
            self._data = DataServer(
                self._host.strip("[]"), config.security, config.max_message_bytes, config.port_range
            )
        self.service.start_reaper()

    @property
    def data_port(self) -> int | None:
        """The port of the data channel pushes are offered; None when none is."""
        return None if self._data is None else self._data.port

    def _add_port(self, server: grpc.aio.Server, config: TransferConfig) -> int:
        """Bind ``self._bind``, or with ``port_range`` (and port 0) the first
        free port of the range; the port."""
        binds = [self._bind]
        if config.port_range is not None and self._bind.endswith(":0"):
            low, high = config.port_range
            binds = [f"{self._host}:{p}" for p in range(low, high + 1)]
        for bind in binds:
            try:
                port = config.security.add_port(server, bind)
            except RuntimeError:  # grpc raises on a taken port where it does not return 0
                port = 0
            if port:
                return port
        raise OSError(f"could not bind the KV transfer server to {binds[0]}..{binds[-1]}")

    async def stop(self, grace_s: float | None = None) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        await self.service.close()
        if self._data is not None:
            self._data.stop()
            self._data = None
        self._executor.shutdown(wait=True)

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    def claim(self, request_id: str) -> Held | None:
        return self.service.claim(request_id)

    def discard(self, request_id: str) -> None:
        self.service.discard(request_id)

    async def _push(self, requests, context: grpc.aio.ServicerContext) -> pb.PushReply:
        push = self.service.open_push(_canceller())
        stream = aiter(requests)
        try:
            async for msg in stream:
                accepting = push.state is TransferState.PENDING
                try:
                    reply = await push.on_message_async(msg, self._executor)
                except TransferError:
                    # grpc hands a client that still has a write pending
                    # INTERNAL ("Internal error from Core") instead of the
                    # status: end the call only once the client has
                    # half-closed (bounded), discarding what it still sends.
                    # The blocks are already released. A client that awaits
                    # the answer to its header is told to half-close now.
                    if accepting:
                        await context.send_initial_metadata(((PUSH_REFUSED_KEY, "1"),))
                    await _until_half_closed(stream)
                    raise
                if reply is not None:
                    await _until_half_closed(stream)
                    return reply
                if accepting:  # the header passed: say so, with a data port if asked
                    await context.send_initial_metadata(self._accept(push, context))
            await push.receiver.drain()  # a failed data connection says why it ended
            raise TransferError(grpc.StatusCode.ABORTED, "stream ended before commit")
        except TransferError as e:
            await context.abort(e.code, e.message)
        except asyncio.CancelledError:
            if not push.expired:
                raise
            # Cancelled by the service, not by the client: tell the client why.
            if push.abandoned:
                await context.abort(grpc.StatusCode.CANCELLED, "the request was aborted")
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"no progress for {self.service.config.lease_s} s: blocks released",
            )
        finally:
            push.close()
        raise AssertionError("unreachable")

    def _accept(
        self, push: IncomingPush, context: grpc.aio.ServicerContext
    ) -> tuple[tuple[str, str], ...]:
        held = ((HELD_BLOCKS_KEY, str(push.receiver.held_blocks)),)
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == DATA_TOKEN_KEY and isinstance(value, str):
                with contextlib.suppress(ValueError):
                    token = bytes.fromhex(value)
        if token is None or len(token) != TOKEN_BYTES or self._data is None:
            return held
        incoming = IncomingData(self._data, token, push.receiver, push.renew)
        if not self._data.expect(token, incoming):
            return held  # a token in use: this push's chunks come over gRPC
        push.receiver.expect_data(incoming)
        return (*held, (DATA_PORT_KEY, str(self._data.port)))

    async def _pull(
        self, request: pb.PullRequest | wire.Malformed, context: grpc.aio.ServicerContext
    ) -> None:
        if isinstance(request, wire.Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed PullRequest: {request.reason}"
            )
        try:
            pull = self.service.open_pull(request, _canceller())
        except TransferError as e:
            await context.abort(e.code, e.message)
        succeeded = False
        try:
            for msg in pull.messages():
                await context.write(msg)
            succeeded = True
        finally:
            pull.close(succeeded)


async def _until_half_closed(stream, timeout_s: float = 10.0) -> None:
    """Wait for the client to end its stream, discarding anything it still sends."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            async for _ in stream:
                pass


def _canceller():
    task = asyncio.current_task()
    assert task is not None
    return task.cancel
