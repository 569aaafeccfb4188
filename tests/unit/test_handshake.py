"""The handshake of raw internal connections (net/handshake.py), over
socketpairs: who gets in, who is refused, and that the server reads exactly
the answer's bytes, never past its bounds, that an answer is bound to the
server's address, and that a silent peer is dropped early."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from net import handshake, sockets
from net.security import ClusterSecurity

pytestmark = pytest.mark.unit

SECRET = ClusterSecurity(b"the cluster secret")
TAG = b"tandem-test"
AFTER = b"the connection's own protocol"
HERE = b"10.0.0.1:5000"  # the server's address: the audience of every answer


class Server:
    """``handshake.accept`` on one end of a socketpair, in a thread."""

    def __init__(
        self,
        security=SECRET,
        tag=TAG,
        max_identity=64,
        timeout_s=10.0,
        audience=HERE,
        answer_start_s=handshake.ANSWER_START_S,
    ) -> None:
        self.client, self.sock = socket.socketpair()
        self.client.settimeout(10)
        self.result: bytes | None = None
        self.error: BaseException | None = None
        args = (security, tag, audience, max_identity, timeout_s, answer_start_s)
        self._thread = threading.Thread(target=self._run, args=args, daemon=True)
        self._thread.start()

    def _run(self, *args) -> None:
        try:
            self.result = handshake.accept(self.sock, *args)
        except BaseException as exc:
            self.error = exc

    def nonce(self) -> bytes:
        data = self.client.recv(handshake.HELLO_BYTES, socket.MSG_WAITALL)
        return handshake.parse_hello(data)

    def finish(self) -> bytes:
        """Wait for the server; then what it left unread of the client's bytes."""
        self._thread.join(30)
        assert not self._thread.is_alive()
        with contextlib.suppress(OSError):  # shut already
            self.client.shutdown(socket.SHUT_WR)
        self.sock.settimeout(10)
        left = b""
        while chunk := self.sock.recv(65536):
            left += chunk
        self.client.close()
        self.sock.close()
        return left

    def refused(self, why: str) -> bool:
        return isinstance(self.error, handshake.HandshakeRefused) and why in str(self.error)


def _connect(server: Server, security=SECRET, tag=TAG, identity=b"router-a", audience=HERE) -> None:
    handshake.connect(server.client, security, tag, identity, audience)
    server.client.sendall(AFTER)


def test_the_right_secret_passes_and_what_follows_is_left_unread():
    server = Server()
    _connect(server)
    left = server.finish()
    assert server.error is None and server.result == b"router-a"
    assert left == AFTER  # the connection's protocol starts right after the answer


def test_there_is_no_empty_secret():
    with pytest.raises(ValueError, match="non-empty"):
        ClusterSecurity(b"")
    assert len(ClusterSecurity.generate().secret) == 32
    assert ClusterSecurity.generate().secret != ClusterSecurity.generate().secret


@pytest.mark.parametrize("secret", [b"", b"the cluster secreT", b"the cluster secret!"])
def test_a_wrong_secret_is_refused(secret):
    """b"": the answer of a peer that keys its MAC with the empty secret (what an
    unconfigured deployment used to accept)."""
    server = Server()
    _connect(server, security=SimpleNamespace(secret=secret))
    assert server.finish() == AFTER
    assert server.result is None and server.refused("cluster secret")


@pytest.mark.parametrize("tag", [b"tandem-kv-data", b"tandem-tesT", b"tandem-test-"])
def test_an_answer_for_another_purpose_is_refused(tag):
    """Another tag, even with the right secret and a tag of the same length."""
    server = Server()
    _connect(server, tag=tag)
    left = server.finish()
    assert server.result is None and server.refused("wrong tag")
    if len(tag) != len(TAG):  # refused on its length: nothing after it read
        assert len(left) == len(tag) + 2 + len(b"router-a") + handshake.MAC_BYTES + len(AFTER)


def test_an_answer_replayed_to_another_nonce_is_refused():
    first = Server()
    nonce = first.nonce()
    recorded = handshake.answer(SECRET, TAG, nonce, b"router-a", HERE)
    first.client.sendall(recorded)
    first.finish()
    assert first.result == b"router-a"
    second = Server()
    assert second.nonce() != nonce
    second.client.sendall(recorded)
    second.finish()
    assert second.result is None and second.refused("cluster secret")


def test_each_connection_gets_a_fresh_nonce():
    nonces = set()
    for _ in range(8):
        server = Server()
        nonces.add(server.nonce())
        server.client.close()
        server._thread.join(30)
        server.sock.close()
    assert len(nonces) == 8


def test_an_identity_over_the_bound_is_refused_before_it_is_read():
    server = Server(max_identity=16)
    nonce = server.nonce()
    identity = b"x" * 17
    server.client.sendall(handshake.answer(SECRET, TAG, nonce, identity, HERE) + AFTER)
    left = server.finish()
    assert server.result is None and server.refused("identity of 17 bytes")
    assert left == identity + left[17 : 17 + handshake.MAC_BYTES] + AFTER


def test_a_huge_identity_length_is_refused_without_waiting_for_its_bytes():
    """The length alone decides: the server neither allocates nor waits for
    64 KiB it will never use (it would time out waiting if it tried)."""
    server = Server(timeout_s=30.0)
    server.nonce()
    head = handshake.MAGIC + bytes([len(TAG)]) + TAG + struct.pack("<H", 0xFFFF)
    server.client.sendall(head)
    assert server.finish() == b""
    assert server.refused("identity of 65535 bytes")


def test_a_client_cannot_make_an_answer_over_the_limits():
    with pytest.raises(ValueError):
        handshake.answer(SECRET, TAG, bytes(16), b"x" * (handshake.MAX_IDENTITY_BYTES + 1), HERE)
    with pytest.raises(ValueError):
        handshake.answer(SECRET, b"t" * 256, bytes(16), b"id", HERE)
    with pytest.raises(ValueError):
        handshake.ClientHandshake(SECRET, b"", b"id", HERE)
    with pytest.raises(ValueError):
        handshake.answer(SECRET, TAG, bytes(16), b"id", b"")  # no audience


@pytest.mark.parametrize("cut", [0, 3, 5, 10, 20, -1])
def test_a_truncated_answer_is_refused(cut):
    server = Server()
    whole = handshake.answer(SECRET, TAG, server.nonce(), b"router-a", HERE)
    server.client.sendall(whole[:cut])
    server.client.shutdown(socket.SHUT_WR)
    assert server.finish() == b""
    assert server.result is None and server.refused("closed mid-handshake")


def test_not_a_handshake_is_refused():
    server = Server()
    server.nonce()
    server.client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    server.finish()
    assert server.refused("not a tandem handshake")
    with pytest.raises(handshake.HandshakeRefused):
        handshake.parse_hello(b"SSH-2.0-OpenSSH_9.6\r\n")


def test_a_silent_client_times_out():
    server = Server(timeout_s=0.2)
    server.nonce()
    server.finish()  # returns: the server gave up on its own
    assert isinstance(server.error, TimeoutError)


def test_a_client_that_does_not_begin_its_answer_is_dropped_before_the_whole_bound():
    """The whole handshake may take an hour here, but the first bytes of the
    answer must come within answer_start_s: a silent stranger holds a slot
    that long, not the whole bound (finish() waits 30 s at most)."""
    server = Server(timeout_s=3600.0, answer_start_s=0.2)
    server.nonce()
    server.finish()
    assert isinstance(server.error, TimeoutError)


def test_an_answer_begun_in_time_may_take_the_whole_bound_to_finish():
    server = Server(timeout_s=30.0, answer_start_s=0.05)
    # The answer's first byte (its magic's) needs no nonce: sent before the
    # HELLO is read, it is in time however late this thread runs.
    server.client.sendall(handshake.MAGIC[:1])
    whole = handshake.answer(SECRET, TAG, server.nonce(), b"router-a", HERE)
    assert whole[:1] == handshake.MAGIC[:1]
    time.sleep(0.3)  # past answer_start_s: only the start of the answer is due by then
    server.client.sendall(whole[1:] + AFTER)
    assert server.finish() == AFTER
    assert server.error is None and server.result == b"router-a"


@pytest.mark.parametrize("dialled", [b"10.0.0.2:5000", b"10.0.0.1:5001", b"unix-abstract:x"])
def test_an_answer_relayed_to_another_server_is_refused(dialled):
    """A relay squats an address the client dials (a freed port or socket
    name), forwards the real server's HELLO to the client and its ANSWER back:
    the answer names the address the client dialled, the server its own."""
    server = Server(audience=HERE)
    _connect(server, audience=dialled)
    assert server.finish() == AFTER
    assert server.result is None and server.refused("cluster secret")


def test_the_audiences_of_both_ends_agree():
    assert handshake.tcp_audience("[::1]", 7) == handshake.tcp_audience("::1", 7) == b"::1:7"
    assert handshake.tcp_audience("10.0.0.1", 5000) == HERE


def test_a_tls_server_drops_a_peer_that_sends_nothing_before_its_tls_handshake():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TimeoutError):
            handshake.first_bytes(b, timeout_s=0.2)
        a.sendall(b"\x16")  # a ClientHello's first byte: left for the TLS handshake
        handshake.first_bytes(b, timeout_s=10)
        assert b.recv(1) == b"\x16"


def test_a_silent_server_times_out_the_client():
    a, b = socket.socketpair()
    with a, b, pytest.raises(TimeoutError):
        handshake.connect(a, SECRET, TAG, b"router-a", HERE, timeout_s=0.2)


def test_the_event_driven_client_answers_byte_by_byte():
    server = Server()
    hello = server.client.recv(handshake.HELLO_BYTES, socket.MSG_WAITALL)
    client = handshake.ClientHandshake(SECRET, TAG, b"router-a", HERE)
    for i in range(len(hello) - 1):
        assert client.feed(hello[i : i + 1]) == (None, b"")
    reply, rest = client.feed(hello[-1:] + b"first frame")
    assert rest == b"first frame" and client.done
    server.client.sendall(reply + AFTER)
    assert server.finish() == AFTER
    assert server.result == b"router-a"
    with pytest.raises(handshake.HandshakeRefused):
        handshake.ClientHandshake(SECRET, TAG, b"r", HERE).feed(b"XXXX" + bytes(16))


def test_a_listener_bounds_the_handshakes_in_progress_and_frees_a_slot_when_one_ends():
    """Strangers who connect and stall hold at most max_handshakes threads;
    past it a connection is closed unserved, and a slot frees as soon as a
    handshake ends (here: its peer goes away)."""
    listener = sockets.listen("127.0.0.1")
    address = listener.getsockname()
    stopped = threading.Event()

    def serve(sock, admission):
        with sock:
            with contextlib.suppress(OSError):
                handshake.accept(sock, SECRET, TAG, HERE, timeout_s=30, answer_start_s=30)
            admission.done()

    accepting = threading.Thread(
        target=sockets.accept_forever,
        args=(listener, stopped.is_set, serve, "test-conn", 2),
        daemon=True,
    )
    accepting.start()

    def hello_bytes(conn: socket.socket) -> int:
        conn.settimeout(10)
        got = b""
        with contextlib.suppress(ConnectionError):
            while len(got) < handshake.HELLO_BYTES:
                chunk = conn.recv(64)
                if not chunk:
                    break
                got += chunk
        return len(got)

    stalled = [socket.create_connection(address) for _ in range(2)]
    try:
        assert [hello_bytes(c) for c in stalled] == [handshake.HELLO_BYTES] * 2
        with socket.create_connection(address) as third:
            assert hello_bytes(third) == 0  # closed unserved
        stalled.pop().close()  # that handshake ends: its slot is free again
        for _ in range(100):
            with socket.create_connection(address) as again:
                if hello_bytes(again) == handshake.HELLO_BYTES:
                    break
        else:
            pytest.fail("no slot came free")
    finally:
        for c in stalled:
            c.close()
        stopped.set()
        listener.close()
