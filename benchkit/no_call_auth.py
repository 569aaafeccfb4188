"""A benchmark-only baseline: cluster security whose internal gRPC calls
carry no MAC and whose servers check none (net/call_auth.py is skipped), so
that bench/kv_transfer.py can measure what the call MAC costs in the same
run. The raw connections' handshake is unchanged. Nothing in the serve
config can build one; no product code imports this module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from net.security import ClusterSecurity


class _Unchecked(grpc.aio.ServerInterceptor):
    """Lets every call through; ``bind`` as SecretInterceptor's, for the server."""

    def bind(self, audience: str) -> None:
        del audience

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], object],
        handler_call_details: grpc.HandlerCallDetails,
    ):
        return await continuation(handler_call_details)


@dataclass(frozen=True)
class NoCallAuth(ClusterSecurity):
    """ClusterSecurity without the per-call MAC (plaintext only)."""

    def interceptor(self, audience: str | None = None) -> _Unchecked:  # type: ignore[override]
        del audience
        return _Unchecked()

    def channel(
        self, address: str, options: Sequence[tuple[str, int | str]] = ()
    ) -> grpc.aio.Channel:
        if self.tls is not None:
            raise ValueError("the no-auth baseline is plaintext only")
        return grpc.aio.insecure_channel(address, options=list(options))
