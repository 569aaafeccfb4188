"""A worker's output streams: each step's outputs and the prefix cache's
events, written to the routers by the engine thread itself.

Every router holds one TCP connection to every worker (the protocol is in
output_wire.py). After each step a decode worker's engine thread groups the
outputs by the router that owns each request, encodes one StepBatch per
router (with the cache events, which every router gets), and writes it to
that router's socket without blocking: no event loop, no other thread sits
between a step and the wire. A prefill worker's requests have no owner
here: its streams carry cache events only, sent as the engine reports them.
A socket that cannot take a frame at once (a router reading slowly) queues
it, and the connection's own thread writes the queue out when the socket
is writable; a queue beyond ``MAX_BACKLOG_BYTES`` closes the connection.

A router on the same machine connects to the worker's Unix socket instead
of its TCP port when the worker offers one (net/local_socket.py:
half the cost of a loopback TCP write each step); the protocol is the same,
without TLS, which only a connection that leaves the machine needs.

With an in-process index, a router that logs in first gets a snapshot of
the worker's cache (right after OPEN), so a router that attaches to a
running worker routes to what it holds.

A router id logs in once: a second stream under the id of a live one is
refused (closed after the handshake), and the live one goes on.

The connection's thread also notices the router going away (the socket
closes or breaks): the worker then aborts every request that router owned
here. The router notices a worker going away the same way and fails those
requests over.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import ssl
import threading
from collections.abc import Callable

from block_index import KVEvent
from net import handshake
from net.local_socket import listen_local, same_user
from net.security import ClusterSecurity
from net.sockets import Admission, PortRange, accept_forever, listen, tune
from protocol.outputs import RequestOutput
from protos.tandem.v1 import worker_pb2
from worker import output_wire as wire

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = handshake.TIMEOUT_S
MAX_BACKLOG_BYTES = 256 << 20
RELOGIN_WAIT_S = 2.0  # how long a second login under a live router id waits for it to end
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)

RouterGone = Callable[[str, list[str]], None]
"""(router id, the requests it owned here): its stream closed."""


class RouterConnection:
    """One router's stream: non-blocking writes from any thread, and a thread
    of its own that flushes what the socket could not take and watches for
    the router closing it."""

    def __init__(self, router_id: str, sock: socket.socket) -> None:
        self.router_id = router_id
        self._sock = sock
        self._lock = threading.Lock()  # one SSL object must not be used by two threads at once
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._backlog_bytes = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.closed = False
        self.why = ""

    def send(self, data: bytes) -> None:
        """Write ``data`` now, or queue it behind what the socket has not taken."""
        with self._lock:
            if self.closed:
                return
            wake = not self._backlog
            if wake:
                sent = self._write(data)
                if sent == len(data) or sent < 0:
                    return
                data = memoryview(data)[sent:]
            self._backlog.append(memoryview(data))
            self._backlog_bytes += len(data)
            if self._backlog_bytes > MAX_BACKLOG_BYTES:
                self._close_locked(f"more than {MAX_BACKLOG_BYTES} bytes unread")
                return
        if wake:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def close(self, why: str) -> None:
        with self._lock:
            self._close_locked(why)

    def run(self) -> None:
        """Flush the backlog and watch the socket until the stream ends; then
        close it (in this thread only, so no one else uses a closed socket)."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                with self._lock:
                    if self.closed:
                        return
                    flags = select.POLLIN | (select.POLLOUT if self._backlog else 0)
                poller.register(self._sock, flags)
                for fd, events in poller.poll():
                    if fd == self._wake_r.fileno():
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                        continue
                    if events & select.POLLOUT:
                        self._flush()
                    if events & ~select.POLLOUT:  # data, hang-up or error
                        self._on_readable()
        finally:
            with self._lock:
                self._close_locked("the stream ended")
            for s in (self._sock, self._wake_r, self._wake_w):
                s.close()

    def _write(self, data: bytes | memoryview) -> int:
        """Bytes the socket took (0: none now; -1: it broke and is closed)."""
        try:
            return self._sock.send(data)
        except _WOULD_BLOCK:
            return 0  # SSL: nothing sent; the same bytes are written again later
        except OSError as exc:
            self._close_locked(f"write failed: {exc}")
            return -1

    def _flush(self) -> None:
        with self._lock:
            while self._backlog and not self.closed:
                head = self._backlog[0]
                sent = self._write(head)
                if sent <= 0:
                    return
                self._backlog_bytes -= sent
                if sent < len(head):
                    self._backlog[0] = head[sent:]
                    return
                self._backlog.popleft()

    def _on_readable(self) -> None:
        """The router writes nothing after its handshake: this is the end."""
        with self._lock:
            try:
                data = self._sock.recv(4096)
            except _WOULD_BLOCK:
                return
            except OSError as exc:
                self._close_locked(f"connection broken: {exc}")
                return
            self._close_locked("the router sent data" if data else "the router closed it")

    def _close_locked(self, why: str) -> None:
        if self.closed:
            return
        self.closed, self.why = True, why
        self._backlog.clear()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes run(), which closes the socket


class OutputServer:
    """Accepts routers' output streams and writes each step's outputs to them."""

    def __init__(
        self,
        host: str,
        security: ClusterSecurity,
        on_router_gone: RouterGone,
        max_frame_bytes: int = 64 << 20,
        local: bool = True,
        ports: PortRange | None = None,
        snapshot: Callable[[], list[KVEvent]] | None = None,
    ) -> None:
        """``snapshot``: the cache's blocks now, as events, sent to each router
        right after it logs in (an in-process index: a router that attaches to
        a running worker learns what it holds); None: none sent.
        ``ports``: the range the TCP listener binds in (net/sockets.py, listen).
        ``local``: offer a Unix socket as well, for routers on this machine
        (``local_address``, "" when not offered or the platform has none).
        Under cluster mutual TLS none is offered: its peers could not show a
        certificate there, and mutual TLS promises that every peer does."""
        self.security = security
        self.max_frame_bytes = max_frame_bytes
        self._on_router_gone = on_router_gone
        self._snapshot = snapshot
        self._ssl = security.server_ssl_context()
        self._listener = listen(host, ports)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        mutual_tls = security.tls is not None and security.tls.ca is not None
        made = listen_local("out") if local and not mutual_tls else None
        self._local_listener, self.local_address = made or (None, "")
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a router's stream left _routers
        self._routers: dict[str, RouterConnection] = {}
        self._owner: dict[str, str] = {}  # request id -> router id
        self._events_seq = 0  # batches of cache events published so far
        self._room: worker_pb2.KVRoom | None = None  # the last KV room published
        self._stopped = False
        self._threads = [
            threading.Thread(
                target=self._accept, args=(listener, tls), name="outputs-accept", daemon=True
            )
            for listener, tls in ((self._listener, True), (self._local_listener, False))
            if listener is not None
        ]
        for thread in self._threads:
            thread.start()

    # ---- requests (event loop thread) ----

    def has_router(self, router_id: str) -> bool:
        return router_id in self._routers

    def own(self, request_id: str, router_id: str) -> bool:
        """Send the request's outputs to ``router_id``; False (and nothing
        changes) when that router has no stream here. One step under the lock
        that a closing stream takes, so no request is owned by a router whose
        stream is already gone (which would leave it running for nobody)."""
        with self._lock:
            if router_id not in self._routers:
                return False
            self._owner[request_id] = router_id
            return True

    def disown(self, request_id: str) -> None:
        with self._lock:
            self._owner.pop(request_id, None)

    # ---- outputs (engine thread) ----

    @property
    def events_seq(self) -> int:
        """Batches of cache events published so far: a router whose stream
        has shown this count has every event published before (or the
        stream opened after them)."""
        with self._lock:
            return self._events_seq

    def publish(
        self,
        outputs: list[RequestOutput],
        events: list[KVEvent],
        room: worker_pb2.KVRoom | None = None,
    ) -> None:
        """Send one step's outputs, each to the router that owns its request,
        and the cache events to every router; ``room``, the worker's KV room,
        to every router when it differs from the last one sent (and on every
        stream's opening frame). Call from one thread at a time (the engine
        thread)."""
        owned: dict[str, list[RequestOutput]] = {}
        with self._lock:
            if room == self._room:
                room = None
            elif room is not None:
                self._room = room
            if events:
                self._events_seq += 1
            seq = self._events_seq if events else 0
            routers = dict(self._routers)
            for out in outputs:
                router = self._owner.get(out.request_id)
                if router is None:
                    continue
                if out.finished:
                    del self._owner[out.request_id]
                owned.setdefault(router, []).append(out)
        pb_events = [
            worker_pb2.CacheEvent(worker=e.worker, stored=e.stored, removed=e.removed, host=e.host)
            for e in events
        ]
        for router_id, conn in routers.items():
            mine = owned.get(router_id)
            if not mine and not pb_events and room is None:
                continue
            batch = worker_pb2.StepBatch(
                deltas=[wire.to_delta(o) for o in mine or ()],
                cache_events=pb_events,
                events_seq=seq,
                room=room,
            )
            for frame in wire.frames(batch, self.max_frame_bytes):
                conn.send(frame)

    # ---- connections ----

    def close(self) -> None:
        """Stop accepting and end every stream (routers see them end)."""
        self._stopped = True
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                with contextlib.suppress(OSError):
                    listener.shutdown(socket.SHUT_RDWR)
                listener.close()
        with self._lock:
            conns = list(self._routers.values())
        for conn in conns:
            conn.close("the worker stops")
        for thread in self._threads:
            thread.join(5)

    def _accept(self, listener: socket.socket, tls: bool) -> None:
        accept_forever(
            listener, lambda: self._stopped, lambda s, a: self._serve(s, a, tls), "outputs-conn"
        )

    def _serve(self, sock: socket.socket, admission: Admission, tls: bool) -> None:
        """One router's connection: TLS first (with the cluster's TLS, if any,
        and ``tls``: not on the local socket), then the handshake, whose
        identity is the router's id. The local socket first admits only
        processes of this worker's own user (local_socket.same_user)."""
        if not tls and not same_user(sock):
            log.warning("refused a local output stream from another user's process")
            sock.close()
            return
        try:
            tune(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                if tls and self._ssl is not None:
                    handshake.first_bytes(sock)
                    sock = self._ssl.wrap_socket(sock, server_side=True)
                # The audience: the address this listener advertises (for the
                # local socket, its name), which the router dialled.
                audience = (self.address if tls else self.local_address).encode()
                identity = handshake.accept(
                    sock, self.security, wire.HANDSHAKE_TAG, audience, timeout_s=HANDSHAKE_TIMEOUT_S
                )
            finally:
                admission.done()
            router_id = identity.decode(errors="replace")
        except (OSError, ValueError):  # ssl.SSLError and HandshakeRefused are OSErrors
            router_id = None
        if router_id is None or self._stopped:
            sock.close()
            return
        sock.setblocking(False)
        conn = RouterConnection(router_id, sock)
        snapshot = self._snapshot_frames()  # before the lock: it takes the engine's
        with self._lock:
            # A router id whose stream is live cannot log in again: the live
            # stream keeps its requests. A router that closed its stream and
            # opens a new one may get here first: wait a little for the close.
            self._freed.wait_for(lambda: router_id not in self._routers, RELOGIN_WAIT_S)
            taken = router_id in self._routers
            if not taken:
                # Registered before the router hears OPEN: it may route a
                # request here (has_router) the moment it does. OPEN is still
                # the first frame, since publish() sees the stream only after
                # this lock; it counts the event batches published before,
                # which this stream never carries.
                self._routers[router_id] = conn
                conn.send(wire.open_frame(self._events_seq, self._room))
                for frame in snapshot:  # before any step's frame
                    conn.send(frame)
        if taken:
            log.warning("refused a second stream for router %s: its stream is live", router_id)
            sock.close()
            return
        log.info("router %s subscribed", router_id)
        try:
            conn.run()
        finally:
            self._closed(conn)

    def _snapshot_frames(self) -> list[bytes]:
        """The cache's blocks as frames, sent right after OPEN. Taken before the
        stream is registered (outside the lock: the snapshot takes the engine's),
        so an event published in between may be missing or stale in the
        router's index: a cache miss, never a wrong output."""
        if self._snapshot is None:
            return []
        try:
            events = self._snapshot()
        except Exception:
            log.exception("taking the cache snapshot for a router failed")
            return []
        pb = [
            worker_pb2.CacheEvent(worker=e.worker, stored=e.stored, host=e.host)
            for e in events
            if e.stored
        ]
        if not pb:
            return []
        return list(wire.frames(worker_pb2.StepBatch(cache_events=pb), self.max_frame_bytes))

    def _closed(self, conn: RouterConnection) -> None:
        with self._lock:
            if self._routers.get(conn.router_id) is not conn:
                return
            del self._routers[conn.router_id]
            self._freed.notify_all()
            gone = [r for r, owner in self._owner.items() if owner == conn.router_id]
            for rid in gone:
                del self._owner[rid]
        log.info("router %s unsubscribed: %s", conn.router_id, conn.why)
        self._on_router_gone(conn.router_id, gone)
