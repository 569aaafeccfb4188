"""Plain and TLS sockets: framing helpers every internal stream shares
(scatter/gather sends and receives, exact reads, the accept loop, listening
in a fixed port range)."""

from __future__ import annotations

import errno
import socket
import ssl
import threading
from collections.abc import Callable, Sequence

_IOV_BATCH = 512  # buffers per sendmsg / recvmsg_into (Linux allows 1024)


PortRange = tuple[int, int]
"""Ports ``low`` to ``high``, both included."""


def listen(host: str, ports: PortRange | None = None) -> socket.socket:
    """A listening TCP socket on ``host``: on a free port the kernel picks
    (``ports`` None), else on the first free one of ``ports``, so that a
    firewall can name the ports internal endpoints use. OSError when every
    port of the range is taken."""
    if ports is None:
        return socket.create_server((host, 0), backlog=socket.SOMAXCONN)
    low, high = ports
    for port in range(low, high + 1):
        try:
            return socket.create_server((host, port), backlog=socket.SOMAXCONN)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no free port in {low}-{high} on {host}")


def tune(sock: socket.socket) -> None:
    """No Nagle delay on the small frames. Socket buffers stay autotuned
    (fixed sizes were slower on loopback)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_buffers(sock: socket.socket, views: Sequence[memoryview | bytes]) -> None:
    """``sendall`` of the concatenated views, without concatenating them."""
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    i = 0
    while i < len(pending):
        sent = sock.sendmsg(pending[i : i + _IOV_BATCH])
        while sent:
            size = pending[i].nbytes
            if sent >= size:
                sent -= size
                i += 1
            else:
                pending[i] = pending[i][sent:]
                sent = 0


def recv_into_buffers(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view from ``sock``; ConnectionError if it closes first."""
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            if view.nbytes and not recv_exact(sock, view):
                raise ConnectionError("data connection closed mid-chunk")
        return
    pending = [v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        got = sock.recvmsg_into(pending[i : i + _IOV_BATCH])[0]
        if got == 0:
            raise ConnectionError("data connection closed mid-chunk")
        while got:
            size = pending[i].nbytes
            if got >= size:
                got -= size
                i += 1
            else:
                pending[i] = pending[i][got:]
                got = 0


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False on a clean close before its first byte."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError("data connection closed mid-frame")
        got += n
    return True


MAX_HANDSHAKES = 256
"""Connections one listener lets run their handshake at once; one more is
closed at once, so that strangers who connect and stall hold a bounded
number of threads (each for the handshake's deadline at most)."""


class Admission:
    """One connection's slot among a listener's handshakes in progress:
    ``done()`` once its handshake is over (passed or failed) frees it."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self._slots = slots
        self._held = True
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._slots.release()


def accept_forever(
    listener: socket.socket,
    stopped: Callable[[], bool],
    serve: Callable[[socket.socket, Admission], None],
    name: str,
    max_handshakes: int = MAX_HANDSHAKES,
) -> None:
    """Serve each connection on a thread of its own until ``stopped()``
    (the owner shuts the listener down to end the wait). ``serve`` calls
    ``admission.done()`` when its handshake is over; past ``max_handshakes``
    at once, a new connection is closed unserved."""
    slots = threading.BoundedSemaphore(max_handshakes)
    while not stopped():
        try:
            sock, _ = listener.accept()
        except OSError:
            if stopped():
                return
            continue
        if not slots.acquire(blocking=False):
            sock.close()
            continue
        admission = Admission(slots)
        threading.Thread(
            target=_serve_admitted, args=(serve, sock, admission), name=name, daemon=True
        ).start()


def _serve_admitted(
    serve: Callable[[socket.socket, Admission], None], sock: socket.socket, admission: Admission
) -> None:
    try:
        serve(sock, admission)
    finally:
        admission.done()


def split_address(address: str) -> str:
    """The host of a gRPC ``host:port`` address (``[v6]:port`` too)."""
    host = address.rsplit(":", 1)[0]
    if host.startswith("ipv4:") or host.startswith("ipv6:"):
        host = host[5:]
    return host.strip("[]")
