"""Attacks on a worker's output streams (log in, take over a router id) and
the login a push needs: the client side of net/handshake.py, spoken by the
attacker itself. benchkit/attacker.py runs them in a process of their own;
each returns an ``Outcome`` (benchkit/attacker_kv.py).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time

from benchkit.attack_outcome import NO_SECRET, Outcome
from net import handshake, local_socket
from net.sockets import split_address
from protos.tandem.v1 import worker_pb2
from worker import output_wire


def login_for_pushes(
    outputs: str, router_id: str, key: bytes = NO_SECRET
) -> tuple[str, socket.socket | None]:
    """A router id whose stream is open on the decode worker, as its pushes
    need: an output stream of the attacker's own when it gets one (the
    socket, kept open by the caller), else ``router_id`` (the real router's).
    ``key``: what the handshake's MAC is keyed with (an insider: the secret)."""
    own = f"router-{secrets.token_hex(4)}"
    try:
        conn = _connect(outputs)
        _answer_hello(conn, output_wire.HANDSHAKE_TAG, own.encode(), key)
        conn.settimeout(5)
        if conn.recv(1):  # the stream's open frame: logged in
            return own, conn
        conn.close()
    except OSError:
        pass
    return router_id, None


def stream_login(address: str, router_id: str, read_s: float, key: bytes = NO_SECRET) -> Outcome:
    """Log in to a worker's output stream (``host:port`` or a Unix socket's
    address) as ``router_id``, the handshake's MAC keyed with ``key``, and
    read what comes for ``read_s``."""
    try:
        conn = _connect(address)
    except OSError as e:
        return Outcome("unreachable", f"{type(e).__name__}: {e}")
    with conn:
        try:
            _answer_hello(conn, output_wire.HANDSHAKE_TAG, router_id.encode(), key)
        except OSError as e:
            return Outcome("dropped", f"in the handshake: {e}")
        return _read_frames(conn, read_s)


def _answer_hello(conn: socket.socket, tag: bytes, identity: bytes, key: bytes = NO_SECRET) -> None:
    """The client side of net/handshake.py, its MAC keyed with ``key``."""
    hello = b""
    while len(hello) < handshake.HELLO_BYTES:
        data = conn.recv(handshake.HELLO_BYTES - len(hello))
        if not data:
            raise ConnectionError(f"closed after {len(hello)} bytes of the hello")
        hello += data
    nonce = handshake.parse_hello(hello)
    tag_field = bytes([len(tag)]) + tag
    id_field = len(identity).to_bytes(2, "little") + identity
    mac = hmac.new(key, tag_field + nonce + id_field, hashlib.sha256).digest()
    conn.sendall(handshake.MAGIC + tag_field + id_field + mac)


def _connect(address: str) -> socket.socket:
    if address.startswith(local_socket.SCHEME):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(10)
        try:
            conn.connect(local_socket.local_path(address))
        except OSError:
            conn.close()
            raise
        return conn
    port = int(address.rsplit(":", 1)[1])
    return socket.create_connection((split_address(address), port), timeout=10)


def _read_frames(conn: socket.socket, read_s: float) -> Outcome:
    reader = output_wire.FrameReader(64 << 20)
    frames = deltas = events = 0
    deadline = time.monotonic() + read_s
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            data = conn.recv(1 << 16)
        except TimeoutError:
            break
        except OSError as e:
            return _stream_outcome(frames, deltas, events, f"then reset: {e}")
        if not data:
            return _stream_outcome(frames, deltas, events, "then closed")
        for payload in reader.feed(data):
            batch = worker_pb2.StepBatch.FromString(payload)
            frames += 1
            deltas += len(batch.deltas)
            events += len(batch.cache_events)
    return _stream_outcome(frames, deltas, events, "still open")


def _stream_outcome(frames: int, deltas: int, events: int, end: str) -> Outcome:
    if frames == 0:
        return Outcome("dropped", f"no frame; {end}")
    detail = f"{frames} frames: {deltas} token deltas, {events} cache events; {end}"
    return Outcome("served", detail)
