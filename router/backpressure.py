"""Backpressure: what one request's unread output may hold in the router.

A decode worker streams a request's tokens as fast as it makes them; the
router hands them to the client as fast as the client accepts them. Both
fronts' writes wait for the client: ``context.write`` in grpc.aio until the
message fits the client's HTTP/2 window, uvicorn's ``send`` until its
transport buffer drains. What the worker sends meanwhile waits in the
request's queue in the router (router/worker_streams.py), where a slow
reader's deltas are folded into one chunk when it accepts the next write.

``UnreadOutput`` counts, per request, the bytes (wire size: token ids, text,
logprobs) and tokens queued plus the chunk being written. Policy:

- past ``limits.max_unread_output_kb`` the request is cut: its queued output
  is dropped, it is aborted on its workers at once (blocks freed), and the
  client gets RESOURCE_EXHAUSTED after the output already written to it
  (HTTP: an SSE error event);
- a write the client has not accepted within ``limits.slow_client_timeout_s``
  ends the request the same way (HTTP: the connection is closed, since no
  event can reach a client that reads nothing).

The worker stream reader never waits on a request's queue: a cut is decided
as the delta arrives, so the other requests on that worker go on unaffected.
``UnreadTotals`` sums every request's figures for the router's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class UnreadTotals:
    """The router's figures over all requests (exported by router/metrics.py)."""

    bytes: int = 0
    """Unread output bytes held now, all requests together."""
    peak_bytes: int = 0
    """The most unread output bytes one request has held since the router started."""
    cut: int = 0
    """Requests ended because they passed the bound."""
    timed_out: int = 0
    """Requests ended because a write waited past the timeout."""


class SlowClient(Exception):
    """A write to the client waited past ``limits.slow_client_timeout_s``."""


@dataclass
class UnreadOutput:
    """One request's output in the router that its client has not accepted yet."""

    max_bytes: int = 0
    """The bound; 0: none (a backend driven without a front)."""
    write_timeout_s: float = 0.0
    """How long one write may wait for the client; 0: no limit."""
    totals: UnreadTotals = field(default_factory=UnreadTotals)
    bytes: int = 0
    tokens: int = 0
    peak_bytes: int = 0
    cut: str | None = None
    """Why the request was ended for its client's slowness; None while it runs."""

    def add(self, n_bytes: int, n_tokens: int) -> bool:
        """Count a delta in; False (and the request is cut) when it would pass
        the bound: the delta is not held then."""
        if self.cut is not None:
            return False
        if self.max_bytes and self.bytes + n_bytes > self.max_bytes:
            self.cut = (
                f"the client read too slowly: {(self.bytes + n_bytes) / 1024:.1f} KB unread, "
                f"past limits.max_unread_output_kb ({self.max_bytes // 1024})"
            )
            self.totals.cut += 1
            return False
        self.bytes += n_bytes
        self.tokens += n_tokens
        self.totals.bytes += n_bytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.totals.peak_bytes = max(self.totals.peak_bytes, self.bytes)
        return True

    def remove(self, n_bytes: int, n_tokens: int) -> None:
        """Count out what the client accepted, or what was dropped."""
        self.bytes -= n_bytes
        self.tokens -= n_tokens
        self.totals.bytes -= n_bytes

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        """Bounds one write to the client by ``write_timeout_s``: past it,
        SlowClient (with the message the client is to get)."""
        if not self.write_timeout_s:
            yield
            return
        timeout = asyncio.timeout(self.write_timeout_s)
        try:
            async with timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise
            self.totals.timed_out += 1
            self.cut = self.cut or (
                f"the client read too slowly: it accepted no output for "
                f"{self.write_timeout_s:g} s (limits.slow_client_timeout_s), "
                f"{self.bytes / 1024:.1f} KB unread"
            )
            raise SlowClient(self.cut) from None
