"""Unix sockets for connections whose two ends are on the same machine.

A decode worker's engine thread writes one frame to each router's output
stream after every step (worker/output_channel.py), and that write
is part of the time per output token. Over loopback TCP the ``send()``
runs the whole TCP receive path in the sender's context, with caches cold
from the forward pass; a Unix socket queues the bytes on the reader's
socket and wakes it, about half the engine thread's cost per frame
(docs/benchmarks.md).

Names live in Linux's abstract namespace: nothing on disk to clean up, and
a name is gone when its socket closes. A name is reachable from processes
of the same kernel and network namespace, which ``host_identity`` names:
a peer compares the other end's identity with its own before it tries one,
and falls back to TCP when the connection fails all the same.

A server on such a socket admits only processes of its own user
(``same_user``: the kernel's SO_PEERCRED of the connecting process), and
then the same handshake as on TCP: another user's process on the machine
is refused before it can try the secret.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import sys
from functools import cache
from pathlib import Path

SCHEME = "unix-abstract:"
"""Address prefix, as gRPC spells an abstract Unix socket."""


@cache
def host_identity() -> str:
    """This kernel's boot id and this process's network namespace: equal for
    two processes that can reach each other's abstract sockets; "" where it
    cannot be told (then no local connection is tried)."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}/{netns}"


def listen_local(prefix: str) -> tuple[socket.socket, str] | None:
    """A listening socket at a fresh abstract name, and its address; None
    where the platform has no abstract namespace or refuses."""
    if not host_identity():
        return None
    name = f"tandem-{prefix}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        return None
    return sock, SCHEME + name


_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (as the
    kernel recorded it at connect); None where the platform cannot tell."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    except OSError:
        return None
    return uid


def same_user(sock: socket.socket) -> bool:
    """Whether the peer of a Unix socket runs as this process's user (False
    when it cannot be told: refused, not trusted)."""
    return peer_uid(sock) == os.getuid()


def local_path(address: str) -> str:
    """The ``connect()`` path of an address from ``listen_local``."""
    if not address.startswith(SCHEME):
        raise ValueError(f"not a local socket address: {address!r}")
    return "\0" + address[len(SCHEME) :]
