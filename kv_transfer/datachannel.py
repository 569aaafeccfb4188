"""The bulk side channel of a push: raw TCP next to the gRPC call.

gRPC's Python layer copies every message at least once per side and caps
loopback pushes at about a quarter of a raw socket. So a push negotiates a
plain TCP connection for its payload, and only the payload:

1. The client opens PushBlocks with a random token in the call's metadata
   (``DATA_TOKEN_KEY``) and writes the header on the gRPC stream.
2. The server checks the layout, reserves the blocks, registers the token
   and answers with initial metadata naming its data port
   (``DATA_PORT_KEY``); without a port the client sends the chunks over
   gRPC as before (a server with the data channel off). A refused header
   is answered with ``PUSH_REFUSED_KEY``: the client half-closes and reads
   the call's status.
3. The client connects to that port (TLS when the cluster has TLS) and
   answers the server's handshake (net/handshake.py) with the tag
   ``HANDSHAKE_TAG`` and the token as its identity, which proves the cluster
   secret; the server drops the connection on a mismatch or an unknown
   token. Then one frame per chunk: a ``FRAME`` header (the chunk's span,
   payload size and xxh3-64 of the payload) followed by the payload, in the
   byte order kv_transfer.proto defines for KVChunk.data; then an ``END``
   frame.
4. The client writes the commit on the gRPC stream; the server waits for
   the data connection to finish, commits and replies there. Every error
   (bad checksum: DATA_LOSS) comes back as the gRPC call's status.

No payload byte is copied in Python: the sender hands views of its pool to
``sendmsg`` and the receiver ``recvmsg_into`` views of the blocks it
reserved (under TLS, ``sendall``/``recv_into`` per view: SSL sockets have
no scatter/gather) (``buffers`` of the sink and source; a staging buffer for stores
without it). Leases, the per-chunk checks and freeing the blocks on any
failure are the receiver's, as for gRPC chunks: the receive thread is the
transfer's chunk write in flight.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc
import xxhash

from net import handshake
from net.security import REFUSED_KEY, ClusterSecurity
from net.sockets import (
    Admission,
    PortRange,
    accept_forever,
    listen,
    recv_exact,
    recv_into_buffers,
    send_buffers,
    tune,
)

from .interface import TransferError, new_staging

if TYPE_CHECKING:
    from .receiver import KVReceiver
    from .sender import KVSender

DATA_TOKEN_KEY = "tandem-kv-data-token"
DATA_PORT_KEY = "tandem-kv-data-port"
PUSH_REFUSED_KEY = REFUSED_KEY  # initial metadata of a push refused at its header
HANDSHAKE_TAG = b"tandem-kv-data"
TOKEN_BYTES = 16
CHUNK_MAGIC, END_MAGIC = b"KVC1", b"KVE1"
# magic, layer_start, layer_end, block_start, block_end, payload bytes, xxh3_64
FRAME = struct.Struct("<4sIIIIQQ")
HANDSHAKE_TIMEOUT_S = handshake.TIMEOUT_S

FrameFilter = Callable[[bytes], bytes | None]


def checksum(views: Sequence[memoryview | bytes]) -> int:
    """xxh3-64 of the concatenated views (an order of magnitude faster than
    zlib.crc32)."""
    if len(views) == 1:
        return xxhash.xxh3_64_intdigest(views[0])
    h = xxhash.xxh3_64()
    for view in views:
        h.update(view)
    return h.intdigest()


def encode_frame(span: tuple[int, int, int, int], nbytes: int, digest: int) -> bytes:
    return FRAME.pack(CHUNK_MAGIC, *span, nbytes, digest)


END_FRAME = FRAME.pack(END_MAGIC, 0, 0, 0, 0, 0, 0)


# ---- sending side ----


class DataSender:
    """Sends a KVSender's chunks over one data connection: ``open``, then
    ``send`` as chunks become ready, then ``end``; each call blocks (run them
    in a worker thread, one at a time) and raises OSError on failure."""

    def __init__(
        self,
        host: str,
        port: int,
        token: bytes,
        sender: KVSender,
        timeout_s: float,
        frame_filter: FrameFilter | None,
        security: ClusterSecurity,
    ) -> None:
        self.host, self.port, self.token = host, port, token
        self.security = security
        self.sender = sender
        self.timeout_s = timeout_s
        self.frame_filter = frame_filter  # the client's message filter: sees each frame's bytes
        self.connected = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._aborted = False

    def open(self) -> None:
        """Connect and answer the handshake (``connected`` tells whether the
        connection was made)."""
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        self.connected = True
        ctx = self.security.client_ssl_context()
        if ctx is not None:
            try:
                sock = ctx.wrap_socket(
                    sock, server_hostname=self.security.server_hostname(self.host)
                )
            except BaseException:
                sock.close()
                raise
        self.start_on(sock)

    def start_on(self, sock: socket.socket) -> None:
        """Answer the handshake on a connected ``sock``, which is this sender's
        from now on (closed by ``end`` or ``close``)."""
        with self._lock:
            if self._aborted:
                sock.close()
                raise ConnectionAbortedError("push abandoned")
            self._sock = sock
        tune(sock)
        audience = handshake.tcp_audience(self.host, self.port)
        handshake.connect(
            sock, self.security, HANDSHAKE_TAG, self.token, audience, HANDSHAKE_TIMEOUT_S
        )

    def send(self, spans: Sequence[tuple[int, int, int, int]]) -> None:
        """One frame per chunk, its payload straight from the blocks."""
        sock = self._connected()
        for span in spans:
            views = self.sender.views(span)
            nbytes = sum(v.nbytes for v in views)
            frame = encode_frame(span, nbytes, checksum(views))
            if self.frame_filter is None:
                send_buffers(sock, [frame, *views])
            else:
                out = self.frame_filter(frame + b"".join(views))
                if out is not None:
                    sock.sendall(out)
            self.sender.bytes_sent += nbytes

    def end(self) -> None:
        """The end frame; then the connection closes."""
        self._connected().sendall(END_FRAME)
        self.close()

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def abort(self) -> None:
        """Make a blocked call return soon (from another thread)."""
        with self._lock:
            self._aborted = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    def _connected(self) -> socket.socket:
        with self._lock:
            if self._aborted or self._sock is None:
                raise ConnectionAbortedError("push abandoned")
            return self._sock


# ---- receiving side ----


class IncomingData:
    """The data connection one push expects, on the receiving side.

    ``done`` is the receiver's chunk write in flight from the moment the
    header is accepted until the connection ended (result) or failed
    (TransferError); it is set once, and only after nothing touches the
    reserved blocks any more, so the receiver may release them then.
    """

    def __init__(
        self, server: DataServer, token: bytes, receiver: KVReceiver, renew: Callable[[], None]
    ) -> None:
        self._server = server
        self.token = token
        self.receiver = receiver
        self._renew = renew
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        # Running: cancelling a wrapper of it (a cancelled handler) must not
        # mark it done while a thread still writes into the blocks.
        self.done.set_running_or_notify_cancel()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False

    def attach(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._sock = sock
            return True

    def abort(self) -> None:
        """The transfer failed: stop receiving; ``done`` is set soon after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sock = self._sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if sock is None:  # never connected: nothing else will set ``done``
            self._server.unregister(self.token, self)
            self.done.set_exception(
                TransferError(grpc.StatusCode.CANCELLED, "push ended before its data connection")
            )

    def serve(self, sock: socket.socket) -> None:
        """Receive every chunk into the reserved blocks (in the connection's thread)."""
        error: TransferError | None = None
        try:
            self._receive(sock)
        except TransferError as e:
            error = e
        except OSError as e:
            error = TransferError(grpc.StatusCode.ABORTED, f"data connection broken: {e}")
        except Exception as e:
            error = TransferError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        with self._lock:
            self._closed = True
            self._sock = None
            sock.close()
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)

    def _receive(self, sock: socket.socket) -> None:
        receiver = self.receiver
        header = memoryview(bytearray(FRAME.size))
        staging: memoryview | None = None
        while True:
            if not recv_exact(sock, header):
                raise ConnectionError("data connection closed before its end frame")
            magic, ls, le, bs, be, nbytes, digest = FRAME.unpack(header)
            if magic == END_MAGIC:
                return
            if magic != CHUNK_MAGIC:
                raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "bad data frame")
            if nbytes > self._server.max_frame_bytes:
                raise TransferError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"data frame of {nbytes} bytes; the limit is {self._server.max_frame_bytes}",
                )
            receiver.check_span(ls, le, bs, be, nbytes)
            blocks = receiver.block_ids[bs:be]
            views = receiver.sink_buffers(blocks, ls, le)
            staged = views is None
            if views is None:
                if staging is None or staging.nbytes < nbytes:
                    staging = new_staging(receiver.sink, nbytes)
                views = [staging[:nbytes]]
            recv_into_buffers(sock, views)
            if checksum(views) != digest:
                raise TransferError(
                    grpc.StatusCode.DATA_LOSS,
                    f"checksum mismatch in layers {ls}:{le} blocks {bs}:{be}",
                )
            if staged:
                receiver.sink.write(blocks, ls, views[0])
            self._renew()


class DataServer:
    """Listens for data connections and hands each to the push it belongs to."""

    def __init__(
        self,
        host: str,
        security: ClusterSecurity,
        max_frame_bytes: int = 64 << 20,
        ports: PortRange | None = None,
    ) -> None:
        self.security = security
        self.max_frame_bytes = max_frame_bytes
        self._ssl = self.security.server_ssl_context()
        # A burst of pushes connects at once: a short backlog drops SYNs, and a
        # dropped SYN is retried after 1, 3, 7... s.
        self._listener = listen(host, ports)
        self.port: int = self._listener.getsockname()[1]
        # The address clients dial: the KV server's host and this port.
        self.audience = handshake.tcp_audience(host, self.port)
        self._expected: dict[bytes, IncomingData] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._accept_forever, name="kv-data", daemon=True)
        self._thread.start()

    def expect(self, token: bytes, incoming: IncomingData) -> bool:
        """Hand the connection that brings ``token`` to ``incoming``; False if
        the token is already expected."""
        with self._lock:
            if token in self._expected:
                return False
            self._expected[token] = incoming
            return True

    def unregister(self, token: bytes, incoming: IncomingData) -> None:
        with self._lock:
            if self._expected.get(token) is incoming:
                del self._expected[token]

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)

    def _accept_forever(self) -> None:
        accept_forever(self._listener, lambda: self._stopped, self._serve, "kv-data-conn")

    def _serve(self, sock: socket.socket, admission: Admission) -> None:
        """TLS first (when configured), then the handshake, which names the
        push this connection brings the data of; dropped unless its token is
        expected and its answer proves the cluster secret."""
        incoming = None
        try:
            tune(sock)
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                if self._ssl is not None:
                    handshake.first_bytes(sock)
                    sock = self._ssl.wrap_socket(sock, server_side=True)
                token = handshake.accept(
                    sock,
                    self.security,
                    HANDSHAKE_TAG,
                    self.audience,
                    TOKEN_BYTES,
                    HANDSHAKE_TIMEOUT_S,
                )
            finally:
                admission.done()
            sock.settimeout(None)
            with self._lock:
                incoming = self._expected.pop(token, None)
        except (OSError, ValueError):  # ssl.SSLError and HandshakeRefused are OSErrors
            incoming = None
        if incoming is None or not incoming.attach(sock):
            sock.close()
            return
        incoming.serve(sock)
