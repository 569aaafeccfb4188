"""The router's end of the workers' output streams.

One connection per worker (worker/output_wire.py), prefill and decode: a
Unix socket when the worker offers one and runs on this machine
(net/local_socket.py), else TCP. A decode worker's stream carries every
step's deltas for this router's requests there, and the worker's cache
events; a prefill worker's, its cache events only. Cache events go to the
backend's index as they arrive (none come with the index in Redis: workers
publish there). Each request reads its deltas from a queue; when a worker's
stream breaks, every request on that worker gets ``LOST`` and the backend
hears of it. A request's queue is bounded by what its client has not read
(router/backpressure.py): the reader never waits on it.

A prefill worker's reply names how many batches of cache events it had
published (``PrefillResult.events_seq``); ``caught_up`` waits until the
stream has brought them, so a request's prefix is in the index before the
request ends, and a client's next request can be routed to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

from kv_transfer import TransferConfig
from net import handshake
from net.local_socket import host_identity, local_path
from net.sockets import split_address, tune
from protos.tandem.v1 import worker_pb2
from router.backpressure import UnreadOutput
from router.pool_manager import WorkerHandle
from worker import output_wire as wire

log = logging.getLogger(__name__)

LOST: Final = None  # put in a request's queue when its worker's stream broke
SUBSCRIBE_TIMEOUT_S = 30.0
EVENTS_WAIT_S = 5.0  # bounds caught_up(): the events are on the wire already
FAILED_FINISHES = frozenset({"error", "abort"})  # a worker's finish reasons that fail a try


class _Cut:
    def __repr__(self) -> str:
        return "CUT"


CUT: Final = _Cut()  # a request's queue ends with it once it passed its bound
Item = worker_pb2.RequestDelta | None | _Cut


class DeltaQueue:
    """One try's deltas from its decode worker's stream, for the request's
    handler. Each delta counts in the request's ``UnreadOutput`` from its
    arrival until the handler comes back for more (``written``: the chunk it
    took went to the client). ``put`` never waits: a delta that would pass
    the bound drops what is queued, queues ``CUT`` and calls ``on_cut``."""

    def __init__(
        self, unread: UnreadOutput | None = None, on_cut: Callable[[], None] | None = None
    ) -> None:
        self.unread = unread if unread is not None else UnreadOutput()
        self.on_cut = on_cut
        self._items: deque[tuple[Item, int, int]] = deque()  # (item, bytes, tokens)
        self._taken = (0, 0)  # bytes and tokens the handler took and has not written
        self._waiter: asyncio.Future[None] | None = None
        self.closed = False

    def put(self, delta: worker_pb2.RequestDelta) -> None:
        if self.closed or self.unread.cut is not None:
            return  # ended: what comes now is nobody's
        size, tokens = delta.ByteSize(), len(delta.token_ids)
        if self.unread.add(size, tokens):
            self._push((delta, size, tokens))
            return
        self._drop_queued()
        self._push((CUT, 0, 0))
        if self.on_cut is not None:
            self.on_cut()

    def put_lost(self) -> None:
        """The worker's stream broke: nothing follows."""
        self._push((LOST, 0, 0))

    def empty(self) -> bool:
        return not self._items

    def next_is_delta(self) -> bool:
        """A delta is queued next (not LOST, not CUT)."""
        return bool(self._items) and isinstance(self._items[0][0], worker_pb2.RequestDelta)

    def next_fails(self) -> bool:
        """The delta queued next ends the request in failure (error or abort)."""
        if not self.next_is_delta():
            return False
        delta = self._items[0][0]
        return delta.finished and delta.finish_reason in FAILED_FINISHES

    def get_nowait(self) -> Item:
        """The next item; IndexError when none is queued."""
        item, size, tokens = self._items.popleft()
        self._taken = (self._taken[0] + size, self._taken[1] + tokens)
        return item

    async def get(self) -> Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    def written(self) -> None:
        """What the handler took is with the client: count it out."""
        self.unread.remove(*self._taken)
        self._taken = (0, 0)

    def close(self) -> None:
        """The try is over: count out everything it held."""
        self.written()
        self._drop_queued()
        self.closed = True

    def _push(self, entry: tuple[Item, int, int]) -> None:
        self._items.append(entry)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _drop_queued(self) -> None:
        while self._items:
            _, size, tokens = self._items.popleft()
            self.unread.remove(size, tokens)


def merge_queued(delta: worker_pb2.RequestDelta, queue: DeltaQueue) -> worker_pb2.RequestDelta:
    """``delta`` with the deltas already queued behind it folded in, up to a
    finished one: when the client (or the router) falls behind the workers,
    it gets one chunk of several tokens instead of several messages (each
    gRPC write costs the router and the client far more than a token's
    bytes). LOST, CUT and a delta that fails the request stay queued: the
    tokens before a failure reach the client before the failure does."""
    while not delta.finished and queue.next_is_delta() and not queue.next_fails():
        later = queue.get_nowait()
        assert isinstance(later, worker_pb2.RequestDelta)
        text = delta.text + later.text
        delta.MergeFrom(later)  # appends tokens and logprobs; later scalars win
        delta.text = text
    return delta


class _OutputStream(asyncio.Protocol):
    """One worker's stream: the handshake, then frames of StepBatch."""

    def __init__(
        self,
        worker: WorkerHandle,
        router_id: str,
        transfer: TransferConfig,
        on_batch: Callable[[worker_pb2.StepBatch], None],
        on_end: Callable[[_OutputStream, str], None],
        audience: str,
        on_room: Callable[[WorkerHandle, worker_pb2.KVRoom], None] | None = None,
    ) -> None:
        """``audience``: the address dialled (the worker's ``outputs`` or
        ``outputs_local``), which the handshake's MAC names."""
        self.worker = worker
        self.router_id = router_id
        self.handshake = handshake.ClientHandshake(
            transfer.security, wire.HANDSHAKE_TAG, router_id.encode(), audience.encode()
        )
        self.on_batch = on_batch
        self.on_end = on_end
        self.on_room = on_room
        self.frames = wire.FrameReader(transfer.max_message_bytes)
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.is_open = False  # the worker accepted the handshake
        self.ended = False
        self.events_seq = 0  # the worker's count of event batches, as this stream showed it
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune(sock)

    def data_received(self, data: bytes) -> None:
        try:
            if not self.handshake.done:
                reply, data = self.handshake.feed(data)
                if reply is not None:
                    assert self.transport is not None
                    self.transport.write(reply)
            for payload in self.frames.feed(data):
                batch = worker_pb2.StepBatch.FromString(payload)
                if not self.is_open:
                    self.is_open = True
                    self.opened.set_result(None)
                else:
                    self.on_batch(batch)
                if batch.events_seq:
                    self._shown(batch.events_seq)
                if self.on_room is not None and batch.HasField("room"):
                    self.on_room(self.worker, batch.room)
        except Exception as exc:  # a bad frame: the stream cannot be trusted any more
            self.end(f"bad output stream: {type(exc).__name__}: {exc}")

    async def wait_events(self, events_seq: int) -> None:
        """Until the stream has shown ``events_seq`` event batches, or ended."""
        if self.ended or self.events_seq >= events_seq:
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (events_seq, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def _shown(self, events_seq: int) -> None:
        self.events_seq = max(self.events_seq, events_seq)
        for seq, waiter in self._waiters:
            if seq <= self.events_seq and not waiter.done():
                waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.end(f"output stream broke: {exc}" if exc else "the output stream ended")

    def end(self, why: str) -> None:
        """Close the stream (once); ``on_end`` hears why ("" when asked to)."""
        if self.ended:
            return
        self.ended = True
        if self.transport is not None:
            self.transport.abort()
        if not self.opened.done():
            self.opened.set_exception(ConnectionError(why or "closed"))
            self.opened.exception()  # subscribe() may have stopped waiting: no warning
        for _, waiter in self._waiters:  # nothing more comes from this stream
            if not waiter.done():
                waiter.set_result(None)
        self.on_end(self, why)


class WorkerStreams:
    def __init__(
        self,
        router_id: str,
        on_events: Callable[[list[worker_pb2.CacheEvent]], None],
        on_broken: Callable[[WorkerHandle, str], None],
        transfer: TransferConfig,
        on_room: Callable[[WorkerHandle, worker_pb2.KVRoom], None] | None = None,
    ) -> None:
        """``transfer``: the cluster's credentials and message limits, which the
        workers' output streams demand; ``on_room``: a decode worker's KV room
        reports (router/admission.py)."""
        self.router_id = router_id
        self.transfer = transfer
        self.on_events = on_events
        self.on_broken = on_broken
        self.on_room = on_room
        self._queues: dict[str, tuple[DeltaQueue, WorkerHandle]] = {}  # request id ->
        self._streams: dict[str, _OutputStream] = {}  # decode worker name -> its stream

    def register(
        self,
        request_id: str,
        worker: WorkerHandle,
        unread: UnreadOutput | None = None,
        on_cut: Callable[[], None] | None = None,
    ) -> DeltaQueue:
        """The queue of a try on ``worker``: its deltas count in ``unread``
        (the request's, shared by its tries); ``on_cut`` is called when one
        passes the bound."""
        queue = DeltaQueue(unread, on_cut)
        self._queues[request_id] = (queue, worker)
        return queue

    def unregister(self, request_id: str) -> None:
        entry = self._queues.pop(request_id, None)
        if entry is not None:
            entry[0].close()

    def routed(self) -> dict[str, WorkerHandle]:
        """The decode worker of every try registered now, by its id
        (``<request id>#<try>``)."""
        return {rid: worker for rid, (_, worker) in list(self._queues.items())}

    async def subscribe(self, worker: WorkerHandle) -> None:
        """Open ``worker``'s output stream; ConnectionError if it is refused or
        does not open in time."""
        await self.unsubscribe(worker)
        loop = asyncio.get_running_loop()
        info = worker.info
        local = info.outputs_local
        here = host_identity()
        if local and self.transfer.local_streams and here and info.host_id == here:
            try:
                await self._open(
                    worker, lambda s: loop.create_unix_connection(s, local_path(local)), local
                )
                return
            except ConnectionError as exc:
                log.warning("%s; trying its TCP address", exc)
        address = info.outputs
        host, port = split_address(address), int(address.rsplit(":", 1)[1])
        security = self.transfer.security
        ctx = security.client_ssl_context()  # None without cluster TLS
        server_name = security.server_hostname(host)
        await self._open(
            worker,
            lambda s: loop.create_connection(s, host, port, ssl=ctx, server_hostname=server_name),
            address,
        )

    async def _open(
        self,
        worker: WorkerHandle,
        connect: Callable[[Callable[[], _OutputStream]], Awaitable[object]],
        audience: str,
    ) -> None:
        """A new stream of ``worker`` over what ``connect(protocol_factory)``
        opens, to the server at ``audience``."""
        stream = _OutputStream(
            worker,
            self.router_id,
            self.transfer,
            self._dispatch,
            self._ended,
            audience,
            self.on_room,
        )
        self._streams[worker.name] = stream
        try:
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT_S):
                await connect(lambda: stream)
                await stream.opened
        except (OSError, TimeoutError) as exc:  # ConnectionError is an OSError
            stream.end("")
            raise ConnectionError(f"output stream of {worker.name}: {exc!r}") from exc

    async def caught_up(self, worker: WorkerHandle, events_seq: int) -> None:
        """Wait until ``worker``'s stream has brought the cache events the
        worker had published when its count was ``events_seq``, so that the
        index has them. Returns at once without an open stream (nothing
        more comes from it) and after ``EVENTS_WAIT_S`` at most."""
        stream = self._streams.get(worker.name)
        if stream is None or not stream.is_open or stream.events_seq >= events_seq:
            return
        try:
            async with asyncio.timeout(EVENTS_WAIT_S):
                await stream.wait_events(events_seq)
        except TimeoutError:
            log.warning(
                "%s's cache events did not arrive within %.0f s (at %d of %d); going on",
                worker.name,
                EVENTS_WAIT_S,
                stream.events_seq,
                events_seq,
            )

    async def unsubscribe(self, worker: WorkerHandle) -> None:
        """Close ``worker``'s stream; its requests get LOST (the worker is out
        of routing already, or is subscribed again)."""
        stream = self._streams.get(worker.name)
        if stream is not None:
            stream.end("")

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.end("")

    def _dispatch(self, batch: worker_pb2.StepBatch) -> None:
        if batch.cache_events:
            self.on_events(batch.cache_events)
        for delta in batch.deltas:
            entry = self._queues.get(delta.request_id)
            if entry is not None:
                entry[0].put(delta)

    def _ended(self, stream: _OutputStream, why: str) -> None:
        worker = stream.worker
        if self._streams.get(worker.name) is stream:
            del self._streams[worker.name]
        if not stream.is_open:
            return  # no request was routed over it
        # Requests on that worker can no longer finish there.
        for queue, owner in list(self._queues.values()):
            if owner is worker:
                queue.put_lost()
        if why:  # not closed by this router: the worker is suspect
            self.on_broken(worker, why)
