"""The handshake that opens every raw internal connection: a KV data
connection (kv_transfer/datachannel.py) and a worker's output stream
(worker/output_channel.py). Under cluster TLS it runs inside the TLS
connection, after the TLS handshake.

    server -> client   HELLO   MAGIC, a fresh random nonce (NONCE_BYTES)
    client -> server   ANSWER  MAGIC, u8 tag length, tag,
                               u16 identity length, identity,
                               HMAC-SHA256(cluster secret,
                                           tag field + nonce + identity field
                                           + audience field)

Integers are little-endian; a "field" is its length followed by its bytes
(the audience's length is a u16 too), so no two (tag, identity, audience)
triples give the same MAC input. The audience is the server's address, never
sent: the client puts in the address it dialled, the server the address it
advertises (``tcp_audience`` for TCP, the ``unix-abstract:`` name for a
local socket). An answer a relay obtained for one server (by squatting a
freed port or socket name, and forwarding the real server's HELLO to a
client that dialled it) is refused by any other server, whose address
differs.
The tag names what the connection is for (``tandem-kv-data``,
``tandem-output-stream``): an answer made for one kind of server is no use
at another. The identity names whom or what it is for (a push's one-time
token, a router's id). The nonce is new on every connection: an answer
recorded on one connection is no use on another.

The server reads exactly the answer's bytes, never more (what follows is
the connection's own protocol), and checks each part before it reads the
next: the magic, the tag's length and bytes (it serves one tag), the
identity's length against its bound (before reading the identity), then
the MAC, in constant time. On any mismatch it closes the connection
without a word; the client learns it from the connection ending. Nothing
answers a good ANSWER either: the connection's protocol goes on.

Both sides bound the handshake by a deadline (``TIMEOUT_S``), so a peer that
sends a byte at a time holds a server's thread for that long at most; the
first bytes of the ANSWER must come within ``ANSWER_START_S`` of the HELLO
(an honest client answers in milliseconds), so a peer that connects and
goes silent holds a listener's handshake slot (net/sockets.py) that long.
The key is never empty: a ClusterSecurity always holds a secret
(security.py), so a peer that does not know it is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

from net.security import ClusterSecurity

MAGIC = b"TSH1"
NONCE_BYTES = 16
HELLO_BYTES = len(MAGIC) + NONCE_BYTES
MAC_BYTES = 32  # HMAC-SHA256
MAX_TAG_BYTES = 255
MAX_IDENTITY_BYTES = 1024
TIMEOUT_S = 10.0
ANSWER_START_S = 2.0
"""Time a server waits for the first bytes of the ANSWER after its HELLO."""
MAX_AUDIENCE_BYTES = 0xFFFF

_HEAD = struct.Struct("<4sB")  # magic, tag length
_ID_LENGTH = struct.Struct("<H")


class HandshakeRefused(ConnectionError):
    """The peer did not complete the handshake as this side expects."""


def hello(nonce: bytes) -> bytes:
    """The server's first bytes."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes")
    return MAGIC + nonce


def parse_hello(data: bytes) -> bytes:
    """The nonce of a server's HELLO (``HELLO_BYTES`` long)."""
    if len(data) != HELLO_BYTES or data[: len(MAGIC)] != MAGIC:
        raise HandshakeRefused("not a tandem handshake")
    return bytes(data[len(MAGIC) :])


def tcp_audience(host: str, port: int) -> bytes:
    """The audience of a TCP server at ``host`` (brackets of a v6 host
    dropped) and ``port``: what both sides put in the MAC."""
    return f"{host.strip('[]')}:{port}".encode()


def answer(
    security: ClusterSecurity, tag: bytes, nonce: bytes, identity: bytes, audience: bytes
) -> bytes:
    """The client's ANSWER to ``nonce`` from the server at ``audience``;
    ValueError if a field is too long."""
    _check_sizes(tag, identity, audience)
    tag_field = bytes([len(tag)]) + tag
    id_field = _ID_LENGTH.pack(len(identity)) + identity
    return MAGIC + tag_field + id_field + _mac(security, tag_field, nonce, id_field, audience)


def _check_sizes(tag: bytes, identity: bytes, audience: bytes) -> None:
    if not audience or len(audience) > MAX_AUDIENCE_BYTES:
        raise ValueError(f"an audience is 1 to {MAX_AUDIENCE_BYTES} bytes, not {len(audience)}")
    if not tag or len(tag) > MAX_TAG_BYTES:
        raise ValueError(f"a tag is 1 to {MAX_TAG_BYTES} bytes, not {len(tag)}")
    if len(identity) > MAX_IDENTITY_BYTES:
        raise ValueError(f"identity of {len(identity)} bytes; the limit is {MAX_IDENTITY_BYTES}")


def _mac(
    security: ClusterSecurity, tag_field: bytes, nonce: bytes, id_field: bytes, audience: bytes
) -> bytes:
    message = tag_field + nonce + id_field + _ID_LENGTH.pack(len(audience)) + audience
    return hmac.new(security.secret, message, hashlib.sha256).digest()


# ---- blocking sockets ----


def first_bytes(sock: socket.socket, timeout_s: float = ANSWER_START_S) -> None:
    """Wait, at most ``timeout_s``, until the peer of a freshly accepted
    ``sock`` has sent something, without reading it: what a TLS server runs
    before its TLS handshake, so a silent peer is dropped as early there as
    before an ANSWER. TimeoutError past it, HandshakeRefused if it closes."""
    previous = sock.gettimeout()
    try:
        sock.settimeout(timeout_s)
        if not sock.recv(1, socket.MSG_PEEK):
            raise HandshakeRefused("the connection closed before its handshake")
    finally:
        sock.settimeout(previous)


def accept(
    sock: socket.socket,
    security: ClusterSecurity,
    tag: bytes,
    audience: bytes,
    max_identity_bytes: int = MAX_IDENTITY_BYTES,
    timeout_s: float = TIMEOUT_S,
    answer_start_s: float = ANSWER_START_S,
) -> bytes:
    """Server side, for the server at ``audience`` (its advertised address):
    send a HELLO, read and check the ANSWER; the identity it proves.
    HandshakeRefused when it proves nothing (the caller closes the
    connection), TimeoutError past ``timeout_s``, or when the ANSWER has not
    begun ``answer_start_s`` after the HELLO; OSError if the socket fails."""
    if not tag or len(tag) > MAX_TAG_BYTES:
        raise ValueError(f"a tag is 1 to {MAX_TAG_BYTES} bytes")
    if not audience or len(audience) > MAX_AUDIENCE_BYTES:
        raise ValueError(f"an audience is 1 to {MAX_AUDIENCE_BYTES} bytes")
    deadline = time.monotonic() + timeout_s
    previous = sock.gettimeout()
    try:
        nonce = secrets.token_bytes(NONCE_BYTES)
        _send(sock, hello(nonce), deadline)
        start_by = min(deadline, time.monotonic() + answer_start_s)
        first = _recv(sock, 1, start_by)  # a silent peer is dropped early
        magic, tag_bytes = _HEAD.unpack(first + _recv(sock, _HEAD.size - 1, deadline))
        if magic != MAGIC:
            raise HandshakeRefused("not a tandem handshake")
        if tag_bytes != len(tag):
            raise HandshakeRefused("wrong tag")
        rest = _recv(sock, tag_bytes + _ID_LENGTH.size, deadline)
        if not hmac.compare_digest(rest[:tag_bytes], tag):
            raise HandshakeRefused("wrong tag")
        (id_bytes,) = _ID_LENGTH.unpack_from(rest, tag_bytes)
        if id_bytes > min(max_identity_bytes, MAX_IDENTITY_BYTES):
            raise HandshakeRefused(f"identity of {id_bytes} bytes")
        tail = _recv(sock, id_bytes + MAC_BYTES, deadline)
        identity, mac = tail[:id_bytes], tail[id_bytes:]
        id_field = rest[tag_bytes:] + identity
        expected = _mac(security, bytes([tag_bytes]) + tag, nonce, id_field, audience)
        if not hmac.compare_digest(mac, expected):
            raise HandshakeRefused("the answer does not prove the cluster secret")
        return identity
    finally:
        sock.settimeout(previous)


def connect(
    sock: socket.socket,
    security: ClusterSecurity,
    tag: bytes,
    identity: bytes,
    audience: bytes,
    timeout_s: float = TIMEOUT_S,
) -> None:
    """Client side, to the server at ``audience`` (the address dialled): read
    the server's HELLO and send the ANSWER. The server says nothing back: a
    refusal shows as the connection ending."""
    _check_sizes(tag, identity, audience)
    deadline = time.monotonic() + timeout_s
    previous = sock.gettimeout()
    try:
        nonce = parse_hello(_recv(sock, HELLO_BYTES, deadline))
        _send(sock, answer(security, tag, nonce, identity, audience), deadline)
    finally:
        sock.settimeout(previous)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("handshake timed out")
    return left


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes (no more) before ``deadline``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(_remaining(deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise HandshakeRefused("the connection closed mid-handshake")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


# ---- event-driven clients (asyncio protocols) ----


class ClientHandshake:
    """The client side for code that is handed bytes as they arrive: feed it
    until it returns the ANSWER to write. The caller bounds the wait."""

    def __init__(
        self, security: ClusterSecurity, tag: bytes, identity: bytes, audience: bytes
    ) -> None:
        _check_sizes(tag, identity, audience)
        self.security, self.tag, self.identity = security, tag, identity
        self.audience = audience
        self._hello = bytearray()
        self.done = False

    def feed(self, data: bytes) -> tuple[bytes | None, bytes]:
        """(the ANSWER once the HELLO is complete, else None; the bytes that
        follow the HELLO). HandshakeRefused if it is not one."""
        if self.done:
            return None, data
        need = HELLO_BYTES - len(self._hello)
        self._hello += data[:need]
        if len(self._hello) < HELLO_BYTES:
            return None, b""
        self.done = True
        nonce = parse_hello(bytes(self._hello))
        return answer(self.security, self.tag, nonce, self.identity, self.audience), data[need:]
