"""The server side of KV transfer, independent of the transport.

A transport (gRPC, in-process) opens an ``IncomingPush`` per PushBlocks call
and an ``OutgoingPull`` per PullBlocks call, feeds it messages, and closes it
in a ``finally``. Each holds a lease; if the transport stalls (peer dead,
client gone quiet) the lease expires, the blocks are released and
``cancel`` stops the call. A committed push goes to the service's
``PushHandler`` (a decode worker starts the request) once its call has
ended; without a handler it waits, leased, for ``claim``.

A push whose blocks do not fit now (the pool is full, or a decode worker's
reserve for its running sequences says no: ``NoRoom``) waits for room,
its lease renewed, for at most ``lease_s``, and is tried again whenever
``notify_room`` says blocks were freed; only then ``PushNoRoom``
(RESOURCE_EXHAUSTED, details starting with ``NO_ROOM_WAIT``), which the
router takes for a full pool, not a failed try; a plain RESOURCE_EXHAUSTED
at once for more blocks than the whole pool.

Every transfer needs the router's grant for it (net/grants.py), made out to
this server's address (``identity``) and checked before any block is
reserved, pinned or looked up: PERMISSION_DENIED otherwise.

Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from engine.block_pool import Held
from net.grants import (
    PULL,
    PUSH,
    GrantChecker,
    GrantRefused,
    GrantUsed,
    pull_digest,
    push_digest,
)
from protos.tandem.v1 import kv_transfer_pb2 as pb

from .feed import KVFeed
from .interface import (
    NO_ROOM_WAIT,
    CommittedPush,
    NoRoom,
    PushHandler,
    PushHeader,
    PushNoRoom,
    TransferConfig,
    TransferError,
    TransferState,
)
from .lease import Lease, LeaseTable, lease_holder
from .pool_store import PoolBlockStore
from .receiver import KVReceiver
from .sender import KVSender
from .wire import Message, layout_from_proto


class KVTransferService:
    def __init__(
        self,
        store: PoolBlockStore,
        config: TransferConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        handler: PushHandler | None = None,
        identity: str = "",
    ) -> None:
        """``identity``: this server's KV address, which grants name (the
        transport sets it once bound)."""
        self.store = store
        self.config = config or TransferConfig()
        self.grants = GrantChecker(self.config.security, identity)
        self.leases = LeaseTable(clock)
        self.handler = handler
        # request id -> (blocks and their holder, lease until claimed): no handler
        self._committed: dict[str, tuple[Held, Lease]] = {}
        self._open_pushes: dict[str, IncomingPush] = {}
        self._refused: dict[str, float] = {}  # discarded request id -> until when
        self._reaper: asyncio.Task[None] | None = None
        self._room = asyncio.Event()  # set (and replaced) when blocks were freed
        self.wait_for_room = True
        """False: a push that does not fit is refused at once, a failed push (a
        plain TransferError, not ``PushNoRoom``: benchkit's retry baseline)."""
        self.num_room_waits = 0  # pushes that waited for room (stats)

    def notify_room(self) -> None:
        """Blocks were freed: pushes waiting for room try again (event loop)."""
        self._room.set()
        self._room = asyncio.Event()

    async def wait_room(self, timeout_s: float) -> None:
        """Until ``notify_room`` or ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout_s)

    def open_push(self, cancel: Callable[[], None]) -> IncomingPush:
        return IncomingPush(self, cancel)

    @property
    def identity(self) -> str:
        return self.grants.target

    @identity.setter
    def identity(self, address: str) -> None:
        self.grants.target = address

    def open_pull(self, request: pb.PullRequest, cancel: Callable[[], None]) -> OutgoingPull:
        return OutgoingPull(self, request, cancel)

    def use_grant(self, grant: bytes, purpose: str, request_id: str, digest: bytes) -> None:
        """Take a transfer's grant, or raise PERMISSION_DENIED (ALREADY_EXISTS:
        a valid grant used before, a replay)."""
        self.take_grant(purpose, request_id, self.check_grant(grant, purpose, request_id, digest))

    def check_grant(self, grant: bytes, purpose: str, request_id: str, digest: bytes) -> float:
        """A good, unused grant's expiry (it stays unused), else as ``use_grant``."""
        with _grant_errors():
            return self.grants.check(grant, purpose, request_id, digest)

    def take_grant(self, purpose: str, request_id: str, expiry: float) -> None:
        """Mark a checked grant used (ALREADY_EXISTS if it was meanwhile)."""
        with _grant_errors():
            self.grants.take(purpose, request_id, expiry)

    def claim(self, request_id: str) -> Held | None:
        committed = self._committed.pop(request_id, None)
        if committed is None:
            return None
        held, lease = committed
        lease.cancel()
        return held

    def discard(self, request_id: str) -> None:
        """The request is gone: free the blocks a push for it holds (committed
        or in flight), and refuse a push for it that has not begun yet."""
        held = self.claim(request_id)
        if held is not None:
            self.store.release(held.holder, held.block_ids)
            return
        push = self._open_pushes.get(request_id)
        if push is not None:
            push.abandon()
            return
        self._refused[request_id] = self.leases.clock() + self.config.lease_s

    def pending_claims(self) -> list[str]:
        return list(self._committed)

    def start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def close(self) -> None:
        """Stop the reaper and release every block held for any transfer."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        self.leases.expire_all()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            self.leases.expire_due()
            now = self.leases.clock()
            for request_id, until in list(self._refused.items()):
                if until <= now:
                    del self._refused[request_id]

    def _deliver(self, receiver: KVReceiver) -> None:
        """Hand a committed push to the handler, or hold it for ``claim``."""
        if self.handler is not None:
            self.handler.committed(
                CommittedPush(
                    receiver.request_id,
                    receiver.held,
                    receiver.token_ids,
                    receiver.next_token_ids,
                    receiver.decode_start,
                    receiver.held_blocks,
                    receiver.cache_salt,
                    receiver.first_token,
                )
            )
            return
        request_id, held = receiver.request_id, receiver.held

        def expire() -> None:
            if self._committed.pop(request_id, None) is not None:
                self.store.release(held.holder, held.block_ids)

        lease = self.leases.grant(self.config.lease_s, expire)
        self._committed[request_id] = (held, lease)


@contextlib.contextmanager
def _grant_errors() -> Iterator[None]:
    try:
        yield
    except GrantUsed as exc:
        raise TransferError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
    except GrantRefused as exc:
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None


ROOM_POLL_S = 0.05
"""A push waiting for room tries again this often even unnotified."""


class IncomingPush:
    def __init__(self, service: KVTransferService, cancel: Callable[[], None]) -> None:
        self._service = service
        self._cancel = cancel
        self.receiver = KVReceiver(service.store, reuse_prefix=True)
        self._committed = False
        self.expired = False  # ended by the service: its lease passed, or abandon()
        self.abandoned = False
        self._lease = service.leases.grant(service.config.lease_s, self._expire)

    @property
    def state(self) -> TransferState:
        return self.receiver.state

    def on_message(self, msg: Message) -> pb.PushReply | None:
        """Apply one message; the reply once the commit is applied."""
        self._lease.renew()
        self._admit(msg)
        return self._after(self.receiver.on_message(msg))

    async def on_message_async(
        self, msg: Message, executor: concurrent.futures.Executor
    ) -> pb.PushReply | None:
        """``on_message`` with chunk copies overlapped in ``executor``."""
        self._lease.renew()
        self._admit(msg)
        if isinstance(msg, pb.TransferHeader):
            return self._after(await self._header(msg))
        return self._after(await self.receiver.on_message_async(msg, executor))

    async def _header(self, msg: pb.TransferHeader) -> bool:
        """Apply the header, waiting (bounded by ``lease_s``) while its blocks
        do not fit; RESOURCE_EXHAUSTED past the bound."""
        service = self._service
        bound_s = service.config.lease_s
        deadline = time.monotonic() + bound_s
        waited = False
        while True:
            try:
                return self.receiver.on_message(msg)
            except NoRoom as exc:
                left = deadline - time.monotonic()
                total = service.store.pool.num_blocks
                if exc.blocks > total:  # it could never fit
                    self._forget()
                    raise TransferError(
                        exc.code, f"{exc.message}: the whole pool holds {total}"
                    ) from None
                if not service.wait_for_room:  # the baseline: a failed push, as before waiting
                    self._forget()
                    raise TransferError(exc.code, exc.message) from None
                if left <= 0 or self.expired:
                    self._forget()
                    raise PushNoRoom(
                        exc.code,
                        f"{NO_ROOM_WAIT}: {exc.message} after waiting {bound_s:g} s "
                        "(transfer.lease_s)",
                    ) from None
                if not waited:
                    waited = True
                    service.num_room_waits += 1
                await service.wait_room(min(left, ROOM_POLL_S))
                self._lease.renew()

    def renew(self) -> None:
        """Progress made elsewhere (a data connection's chunk); thread-safe."""
        self._lease.renew()

    def _admit(self, msg: Message) -> None:
        """Check a header's request before the receiver reserves a block: its
        grant first (a stranger learns nothing of the request), then the
        request; the grant is used only once the push is sure to start, so a
        push refused here can be retried with the same grant."""
        if self.receiver.state is TransferState.PENDING and isinstance(msg, pb.TransferHeader):
            service = self._service
            try:
                expiry = service.check_grant(
                    msg.grant, PUSH, msg.request_id, push_digest(msg.cache_salt)
                )
            except TransferError:
                self.receiver.fail()
                raise
            self._check_request_id(msg.request_id)
            try:
                if service.handler is not None:
                    service.handler.check(msg.request_id, msg.decode_start)
                service.take_grant(PUSH, msg.request_id, expiry)
            except TransferError:
                self._forget()
                raise

    def _after(self, done: bool) -> pb.PushReply | None:
        request_id = self.receiver.request_id
        if not done:
            return None
        self._committed = True
        return pb.PushReply(
            request_id=request_id,
            block_ids=self.receiver.block_ids,
            bytes_received=self.receiver.bytes_received,
        )

    def close(self) -> None:
        """The transport is done with the call (its reply handed over, or it
        failed). A committed push is delivered only now, so the decode's
        first steps do not compete with the reply for the CPU."""
        self._lease.cancel()
        request_id = self.receiver.request_id
        if self._service._open_pushes.get(request_id) is self:
            del self._service._open_pushes[request_id]
        if self._committed and self.state is TransferState.SUCCEEDED:
            self._committed = False
            self._service._deliver(self.receiver)
        self.receiver.fail()

    def abandon(self) -> None:
        """Its request was cancelled: free the blocks and end the call."""
        self.abandoned = True
        self._expire()

    def _check_request_id(self, request_id: str) -> None:
        service = self._service
        code, error = grpc.StatusCode.OK, ""
        if not request_id:
            code, error = grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"
        elif request_id in service._committed or request_id in service._open_pushes:
            code = grpc.StatusCode.ALREADY_EXISTS
            error = f"a push for request_id {request_id!r} is already held"
        elif request_id in service._refused:
            code, error = grpc.StatusCode.CANCELLED, f"request {request_id!r} was cancelled"
        if error:
            self.receiver.fail()
            raise TransferError(code, error)
        service._open_pushes[request_id] = self
        self.receiver.request_id = request_id  # a refused header leaves it empty

    def _forget(self) -> None:
        self._service._open_pushes.pop(self.receiver.request_id, None)
        self.receiver.request_id = ""
        self.receiver.fail()

    def _expire(self) -> None:
        self.expired = True
        self.close()
        self._cancel()


class OutgoingPull:
    def __init__(
        self, service: KVTransferService, request: pb.PullRequest, cancel: Callable[[], None]
    ) -> None:
        store = service.store
        service.use_grant(
            request.grant, PULL, request.request_id, pull_digest(request.block_hashes)
        )
        theirs = layout_from_proto(request.layout)
        field = store.layout.mismatch(theirs)
        if field is not None:
            raise TransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch in {field}: holder has {getattr(store.layout, field)!r}, "
                f"puller {getattr(theirs, field)!r}",
            )
        if (why := store.layout.unmappable(theirs)) is not None:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout: {why}")
        self._cancel = cancel
        holder = lease_holder("send", request.request_id)
        block_ids, token_ids = store.pin_hashes(holder, request.block_hashes)
        hashes: Sequence[bytes] = request.block_hashes[: len(block_ids)]
        feed = KVFeed.ready(store, threading.RLock(), holder, block_ids, pinned=True)
        header = PushHeader(request.request_id, token_ids, hashes)
        self.sender = KVSender(feed, header, service.config.chunk_bytes)
        self._lease = service.leases.grant(service.config.lease_s, self._expire)

    def messages(self) -> Iterator[bytes]:
        for msg in self.sender.messages():
            self._lease.renew()
            yield msg

    def close(self, succeeded: bool = False) -> None:
        self._lease.cancel()
        self.sender.close(succeeded)

    def _expire(self) -> None:
        self.close()
        self._cancel()
