"""A benchmark-only baseline: cluster security whose internal gRPC calls
carry no MAC and whose servers check none (net/call_auth.py is skipped), so
that bench/kv_transfer.py can measure what the call MAC costs in the same
run. The raw connections' handshake is unchanged. Nothing in the serve
config can build one; no product code imports this module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from net.security import ClusterSecurity


@dataclass(frozen=True)
class NoCallAuth(ClusterSecurity):
    """ClusterSecurity without the per-call MAC (plaintext only)."""

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return []

    def channel(
        self, address: str, options: Sequence[tuple[str, int | str]] = ()
    ) -> grpc.aio.Channel:
        if self.tls is not None:
            raise ValueError("the no-auth baseline is plaintext only")
        return grpc.aio.insecure_channel(address, options=list(options))
