"""Internal gRPC calls prove the cluster secret without sending it.

A client signs each call in its metadata (``AUTH_KEY``):

    v2.<timestamp ms>.<nonce, hex>.<HMAC-SHA256(secret, DOMAIN, audience, method,
                                                timestamp, nonce), hex>

The audience is the address of the server called, as the client dials it
(``ClusterSecurity.channel`` signs with the address it opens the channel to);
the server checks it against its own advertised address (the one workers
publish and grants name), set once it is bound. The server (``CallVerifier``,
run by net/security.py's SecretInterceptor before a request is deserialized)
recomputes the MAC and compares in constant time, refuses a timestamp outside
``SKEW_S`` of its own clock, and refuses a nonce it has seen. The MAC covers
the method's full path, so a signature made for one method is no use on
another, and the audience, so a signature made for one server is no use on
another (each server's replay cache knows only its own calls); a sniffer who
records a call cannot replay it (the nonce is remembered while the timestamp
is in the window, and a timestamp past the window is refused), and learns
nothing of the secret (it is never on the wire).

The replay cache is bounded (``MAX_NONCES``): when full, it forgets its
oldest nonces and from then on refuses any call stamped no later than the
newest one it forgot, so forgetting never lets a replay through.

What the MAC does not cover: the messages of the call. Without cluster TLS
an attacker on the path can still read them, or cut a call and splice its
own bytes into the stream; cluster TLS (security.cluster_tls_*) closes that.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Sequence

import grpc

AUTH_KEY = "tandem-call-auth"
VERSION = "v2"
DOMAIN = b"tandem-grpc-call"
NONCE_BYTES = 16
SKEW_S = 60.0
"""Largest difference between a call's timestamp and the server's clock."""
MAX_NONCES = 1 << 16
"""Nonces a server remembers (each about 100 bytes)."""

Clock = Callable[[], float]


def _mac(secret: bytes, audience: str, method: str, stamp: str, nonce: str) -> str:
    # No part holds a NUL (addresses, method paths, digits, hex): unambiguous.
    parts = (DOMAIN, audience.encode(), method.encode(), stamp.encode(), nonce.encode())
    message = b"\0".join(parts)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _method_name(method: str | bytes) -> str:
    return method.decode() if isinstance(method, bytes) else method


class CallSigner:
    """The client side: the metadata entry that signs one call to the server
    at ``audience`` (the address dialled)."""

    def __init__(self, secret: bytes, audience: str, clock: Clock = time.time) -> None:
        self._secret = secret
        self.audience = audience
        self._clock = clock

    def __repr__(self) -> str:
        return f"CallSigner(audience={self.audience!r})"

    def sign(self, method: str | bytes) -> tuple[str, str]:
        """(AUTH_KEY, value) for a call of ``method`` ("/pkg.Service/Method")."""
        stamp = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(NONCE_BYTES)
        mac = _mac(self._secret, self.audience, _method_name(method), stamp, nonce)
        return AUTH_KEY, f"{VERSION}.{stamp}.{nonce}.{mac}"

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """One client interceptor per call shape (grpc.aio files each under one)."""
        return [
            _SignUnaryUnary(self),
            _SignUnaryStream(self),
            _SignStreamUnary(self),
            _SignStreamStream(self),
        ]

    def signed(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        pairs = [(k, v) for k, v in (details.metadata or ()) if k != AUTH_KEY]
        pairs.append(self.sign(details.method))
        return details._replace(metadata=grpc.aio.Metadata(*pairs))


class _SignUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, signer: CallSigner) -> None:
        self._signer = signer

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._signer.signed(client_call_details), request)


class _SignUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, signer: CallSigner) -> None:
        self._signer = signer

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._signer.signed(client_call_details), request)


class _SignStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, signer: CallSigner) -> None:
        self._signer = signer

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._signer.signed(client_call_details), request_iterator)


class _SignStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, signer: CallSigner) -> None:
        self._signer = signer

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._signer.signed(client_call_details), request_iterator)


class CallVerifier:
    """The server side: checks a call's signature, remembers its nonce.
    ``audience`` is this server's advertised address; until it is known
    (``bind``) every call is refused."""

    def __init__(
        self,
        secret: bytes,
        audience: str | None = None,
        clock: Clock = time.time,
        skew_s: float = SKEW_S,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self._secret = secret
        self.audience = audience
        self._clock = clock
        self._skew_ms = int(skew_s * 1000)
        self._max_nonces = max_nonces
        self._seen: set[str] = set()
        self._by_stamp: list[tuple[int, str]] = []  # heap of (timestamp ms, nonce)
        self._floor_ms = -1  # calls stamped at or before it are refused
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CallVerifier(audience={self.audience!r})"

    def bind(self, audience: str) -> None:
        """This server's own address, as it advertises it (once it is bound)."""
        if not audience:
            raise ValueError("a server's audience is its non-empty address")
        self.audience = audience

    def check(
        self, method: str | bytes, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> str | None:
        """None when the call proves the secret; else why not (for the status)."""
        value = next((v for k, v in metadata or () if k == AUTH_KEY), None)
        if value is None:
            return f"no {AUTH_KEY} metadata"
        if self.audience is None:
            return "the server does not know its own address yet"
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit():
            return f"malformed {AUTH_KEY} metadata"
        _, stamp, nonce, mac = parts
        expected = _mac(self._secret, self.audience, _method_name(method), stamp, nonce)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return "the call's MAC does not prove the cluster secret for this server's address"
        stamp_ms = int(stamp)
        now_ms = int(self._clock() * 1000)
        if abs(now_ms - stamp_ms) > self._skew_ms:
            return "the call's timestamp is outside the allowed clock skew"
        return self._remember(nonce, stamp_ms, now_ms)

    def _remember(self, nonce: str, stamp_ms: int, now_ms: int) -> str | None:
        with self._lock:
            self._forget_before(now_ms - self._skew_ms)
            if stamp_ms <= self._floor_ms:
                return "the call's timestamp is too old for the replay cache"
            if nonce in self._seen:
                return "replayed call (nonce seen before)"
            while len(self._seen) >= self._max_nonces:
                stamp, old = heapq.heappop(self._by_stamp)
                self._seen.discard(old)
                self._floor_ms = max(self._floor_ms, stamp)
            if stamp_ms <= self._floor_ms:
                return "the call's timestamp is too old for the replay cache"
            self._seen.add(nonce)
            heapq.heappush(self._by_stamp, (stamp_ms, nonce))
            return None

    def _forget_before(self, oldest_ms: int) -> None:
        """Drop nonces whose timestamps the skew window refuses anyway."""
        while self._by_stamp and self._by_stamp[0][0] < oldest_ms:
            _, old = heapq.heappop(self._by_stamp)
            self._seen.discard(old)
