"""How internal endpoints (KV transfer, decode output streams) trust a peer.

Two locks:

- A cluster secret, always set (``ClusterSecurity`` refuses an empty one;
  ``ClusterSecurity.generate`` makes a random one). Every internal gRPC call
  proves it without sending it (call_auth.py: a MAC over the server's
  address, the method, a timestamp and a nonce, checked by
  ``SecretInterceptor`` before a request is deserialized), and every raw
  connection (KV data, output streams) proves it in its handshake (an HMAC
  of the server's nonce and address, handshake.py).
  Servers compare in constant time and answer UNAUTHENTICATED, or close the
  connection, without reading anything else.
- TLS from PEM files, optional: the server presents ``cert``/``key``; with
  ``ca`` set, servers demand, and clients present, a certificate signed by
  it (mutual TLS), and clients check the server's against it.

The secret never appears in a repr, a log line or a command line: workers
receive it inside their (pickled) TransferConfig.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from net.call_auth import CallSigner, CallVerifier

SECRET_BYTES = 32
"""Size of a generated cluster secret."""
# Initial metadata of a client-streaming call refused before its messages are
# read: the client half-closes, then reads the status (see grpc_client.py).
REFUSED_KEY = "tandem-kv-refused"
REFUSED_DRAIN_S = 10.0


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one endpoint."""

    cert: str
    """Certificate chain this endpoint presents."""
    key: str
    """Its private key."""
    ca: str | None = None
    """CA that signs the peers' certificates; set: mutual TLS and server checks."""
    server_name: str | None = None
    """Name clients expect in servers' certificates; None: the address's host."""

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.ca).read_bytes() if self.ca else None
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), ca


@dataclass(frozen=True)
class ClusterSecurity:
    """Authentication and encryption of the internal endpoints."""

    secret: bytes = field(repr=False)
    """Shared secret of the cluster; never empty (there is no open mode)."""
    tls: TLSFiles | None = None
    """TLS of every internal server and client; None: plaintext."""

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or not self.secret:
            raise ValueError("the cluster secret must be non-empty bytes")

    @classmethod
    def generate(cls, tls: TLSFiles | None = None) -> ClusterSecurity:
        """A fresh random secret (``SECRET_BYTES``): what a deployment without a
        configured one uses, and the default of a TransferConfig."""
        return cls(secrets.token_bytes(SECRET_BYTES), tls)

    # ---- the secret on gRPC calls ----

    def call_signer(self, audience: str) -> CallSigner:
        """What a client uses to sign each internal call to the server at
        ``audience``, the address it dials (call_auth.py)."""
        return CallSigner(self.secret, audience)

    def interceptor(self, audience: str | None = None) -> SecretInterceptor:
        """The server side: every call must carry a valid, fresh MAC made for
        ``audience``, this server's advertised address (``bind`` it once the
        port is known; until then every call is refused)."""
        return SecretInterceptor(CallVerifier(self.secret, audience))

    # ---- gRPC ----

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` with TLS when configured; the port (0: failed)."""
        if self.tls is None:
            return server.add_insecure_port(address)
        cert, key, ca = self.tls.read()
        creds = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )
        return server.add_secure_port(address, creds)

    def channel(
        self, address: str, options: Sequence[tuple[str, int | str]] = ()
    ) -> grpc.aio.Channel:
        """A client channel to the internal server at ``address``; it signs
        every call for that address, so ``address`` must be the one the server
        advertises (a worker's ``kv_address``, a server's ``.address``)."""
        interceptors = self.call_signer(address).interceptors()
        if self.tls is None:
            return grpc.aio.insecure_channel(
                address, options=list(options), interceptors=interceptors
            )
        cert, key, ca = self.tls.read()
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        opts = list(options)
        if self.tls.server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return grpc.aio.secure_channel(address, creds, options=opts, interceptors=interceptors)

    # ---- raw TCP (the data channel) ----

    def server_ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        # No TLS 1.3 session tickets: a data connection is never resumed, and a
        # ticket the sender never reads makes its close() send a RST that can
        # destroy the tail of the payload still in flight to us.
        ctx.num_tickets = 0
        ctx.load_cert_chain(self.tls.cert, self.tls.key)
        if self.tls.ca:
            ctx.load_verify_locations(self.tls.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def server_hostname(self, host: str) -> str | None:
        """The name a TLS client checks the server's certificate against:
        ``cluster_tls_server_name`` when set, else the host dialled; None
        without cluster TLS."""
        if self.tls is None:
            return None
        return self.tls.server_name or host

    def client_ssl_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(self.tls.cert, self.tls.key)
        if self.tls.ca:
            ctx.load_verify_locations(self.tls.ca)
        else:
            ctx.load_default_certs()
        return ctx


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata does not prove the cluster secret
    (call_auth.py), before its requests are deserialized."""

    def __init__(self, verifier: CallVerifier) -> None:
        self._verifier = verifier

    def bind(self, audience: str) -> None:
        """The server's own address, as it advertises it."""
        self._verifier.bind(audience)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], object],
        handler_call_details: grpc.HandlerCallDetails,
    ):
        why = self._verifier.check(
            handler_call_details.method, handler_call_details.invocation_metadata
        )
        handler = await continuation(handler_call_details)
        if why is None:
            return handler
        return _refusing(handler, f"cluster authentication failed: {why}")


async def _refuse(_request, context: grpc.aio.ServicerContext, why: str) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)


async def _refuse_stream(requests, context: grpc.aio.ServicerContext, why: str) -> None:
    """Refuse a client-streaming call: grpc may report INTERNAL to a client
    whose write is pending when the status arrives, so say "refused" first,
    discard what it still sends until it half-closes (bounded), then abort."""
    await context.send_initial_metadata(((REFUSED_KEY, "1"),))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(REFUSED_DRAIN_S):
            async for _ in requests:
                pass
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)


def _refusing(handler, why: str):
    """A handler of the same shape as ``handler`` that refuses the call."""
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    # Requests are not deserialized: a refused call's bytes are never parsed.
    refuse = _refuse_stream if handler.request_streaming else _refuse
    return make(
        functools.partial(_call_refuse, refuse, why),
        request_deserializer=None,
        response_serializer=None,
    )


async def _call_refuse(refuse, why: str, request, context: grpc.aio.ServicerContext) -> None:
    await refuse(request, context, why)
