"""What every request goes through, whichever front (gRPC or HTTP) it came by.

    call = lifecycle.begin("grpc")          # counted in flight from here
    try:
        call.admit()                        # UNAVAILABLE / RESOURCE_EXHAUSTED
        inp = await to_generate_input(...)  # INVALID_ARGUMENT
        call.claim(inp)                     # ALREADY_EXISTS
        async with call.deadline(timeout_s), contextlib.aclosing(call.stream()) as items:
            async for item in items: ...    # TokenDelta..., then one GenerateResult
    finally:
        call.finish(code)                   # status counted, metrics, one log line

``stream()`` always closes the backend's iterator (which aborts the request
on the workers) and turns backend failures into ``RequestError(INTERNAL)``.
The deadline lives in the caller's task, so it also bounds the writes;
``call.unread`` bounds what a slow client makes the router hold
(router/backpressure.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import grpc

from worker.logfmt import log_event

from .backend import Backend, GenerateInput, GenerateResult, TokenDelta
from .backpressure import UnreadOutput
from .limits import RequestLimits
from .messages import RequestError
from .metrics import RouterMetrics
from .resume import finished_at_once
from .tenancy import CacheDomains

STARTING = "the server is starting"
"""``Lifecycle.unavailable`` while the backend starts."""

log = logging.getLogger(__name__)


@dataclass
class ServiceStats:
    """Live counters: requests in flight and finished calls by status code name."""

    in_flight: int = 0
    totals: Counter[str] = field(default_factory=Counter)


class Lifecycle:
    """Admission, request-id claims, in-flight accounting and metrics, shared
    by the gRPC service and the HTTP front."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_queued_requests: int = 1024,
        request_timeout_s: float = 600.0,
        metrics: RouterMetrics | None = None,
        cache_domains: CacheDomains | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        self.backend = backend
        self.cache_domains = cache_domains or CacheDomains()
        """How a request's tenant (its prefix-cache domain) is found, on both fronts."""
        self.max_queued_requests = max_queued_requests
        self.limits = limits or RequestLimits()
        self.in_flight_by_key: Counter[bytes] = Counter()
        """Requests in flight per API key (by the key's digest)."""
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics or RouterMetrics()
        self.stats = ServiceStats()
        self.unavailable: str | None = None
        """When set, new calls get UNAVAILABLE with this message (starting, draining)."""
        self.active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self, protocol: str) -> Call:
        self.stats.in_flight += 1
        self.metrics.in_flight.set(self.stats.in_flight)
        self._idle.clear()
        return Call(self, protocol)

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self._idle.wait()

    def _end(self, call: Call, code: grpc.StatusCode) -> None:
        self.stats.in_flight -= 1
        self.stats.totals[code.name] += 1
        self.metrics.in_flight.set(self.stats.in_flight)
        self.metrics.requests.labels(call.protocol, code.name).inc()
        if self.stats.in_flight == 0:
            self._idle.set()

    def timeout_s(self, client_remaining_s: float | None) -> float:
        """The request's time limit: the client's deadline, capped by the server's."""
        if client_remaining_s is None:
            return self.request_timeout_s
        return min(max(client_remaining_s, 0.0), self.request_timeout_s)


class Call:
    """One request, from ``Lifecycle.begin`` to ``finish``."""

    def __init__(self, lifecycle: Lifecycle, protocol: str) -> None:
        self.lifecycle = lifecycle
        self.protocol = protocol
        self.start = time.perf_counter()
        self.inp: GenerateInput | None = None
        self.result: GenerateResult | None = None
        self.first_token_time: float | None = None
        self._claimed = False
        self._finished = False
        self._key: bytes | None = None  # the API key's digest, counted while in flight
        limits = lifecycle.limits
        self.unread = UnreadOutput(
            limits.max_unread_output_bytes,
            limits.slow_client_timeout_s,
            lifecycle.metrics.unread,
        )
        """What the client has not accepted yet (router/backpressure.py); the
        backend counts it, the front's writes are bounded by it."""

    def admit(self, key: bytes | None = None) -> None:
        """Admit the call, counted against ``key`` (an API key's digest; None: no key)."""
        lc = self.lifecycle
        if lc.unavailable is not None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, lc.unavailable)
        if lc.stats.in_flight > lc.max_queued_requests:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many requests in flight (limit {lc.max_queued_requests}); retry later",
            )
        if key is None:
            return
        limit = lc.limits.max_in_flight_per_key
        if lc.in_flight_by_key[key] >= limit:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this API key has {limit} requests in flight, its limit; retry later",
            )
        lc.in_flight_by_key[key] += 1
        self._key = key

    def claim(self, inp: GenerateInput) -> None:
        """Reserve the request id while the request runs (ALREADY_EXISTS if taken)."""
        if inp.request_id in self.lifecycle.active:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {inp.request_id!r} is already running"
            )
        self.lifecycle.active.add(inp.request_id)
        self.inp, self._claimed = replace(inp, unread=self.unread), True

    @contextlib.asynccontextmanager
    async def deadline(self, timeout_s: float) -> AsyncIterator[None]:
        """Bounds the block; an expiry becomes RequestError(DEADLINE_EXCEEDED)."""
        timeout = asyncio.timeout(timeout_s)
        try:
            async with timeout:
                yield
        except TimeoutError:
            if not timeout.expired():
                raise
            raise RequestError(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded before generation finished"
            ) from None

    async def stream(self) -> AsyncIterator[TokenDelta | GenerateResult]:
        """The backend's deltas, then its result, with latencies recorded."""
        assert self.inp is not None, "claim() first"
        metrics = self.lifecycle.metrics
        if self.inp.resumed_finish is not None:  # its resumed tokens ended it
            items = finished_at_once(self.inp)
        else:
            items = self.lifecycle.backend.generate(self.inp)
        last = self.start
        try:
            async for item in items:
                now = time.perf_counter()
                if isinstance(item, GenerateResult):
                    self.result = item
                    metrics.observe_result(item, now - self.start)
                    yield item
                    return
                if self.first_token_time is None:
                    self.first_token_time = now
                else:
                    metrics.itl.observe(now - last)
                last = now
                yield item
            raise RuntimeError("the backend ended the stream without a result")
        except (asyncio.CancelledError, GeneratorExit, RequestError):
            raise
        except Exception as e:
            log.exception("request %s failed in the backend", self.inp.request_id)
            raise RequestError(grpc.StatusCode.INTERNAL, f"generation failed: {short(e)}") from None
        finally:
            await _close(items)

    def finish(self, code: grpc.StatusCode) -> None:
        """Count the request's status (once) and log it."""
        if self._finished:
            return
        self._finished = True
        if self._claimed and self.inp is not None:
            self.lifecycle.active.discard(self.inp.request_id)
        if self._key is not None:
            by_key = self.lifecycle.in_flight_by_key
            by_key[self._key] -= 1
            if by_key[self._key] <= 0:
                del by_key[self._key]
        self.lifecycle._end(self, code)
        fields: dict[str, object] = {
            "request_id": self.inp.request_id if self.inp else None,
            "protocol": self.protocol,
            "status": code.name,
            "e2e_ms": round((time.perf_counter() - self.start) * 1e3, 2),
        }
        if self.result is not None:
            r = self.result
            fields.update(
                finish_reason=r.finish_reason,
                prompt_tokens=r.prompt_tokens,
                cached_tokens=r.cached_tokens,
                completion_tokens=r.completion_tokens,
                ttft_ms=round(r.ttft_s * 1e3, 2),
                prefill_worker=r.prefill_worker,
                decode_worker=r.decode_worker,
            )
        log_event(log, "request_done", **fields)


def short(e: BaseException, limit: int = 200) -> str:
    text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _close(stream: AsyncIterator) -> None:
    """Close the backend iterator (which aborts the request); never raises."""
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        log.exception("closing a backend stream failed")
