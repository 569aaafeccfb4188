"""The public gRPC API (``tandem.v1.Tandem``) over a ``Backend``.

One ``Generate`` call, in order: refuse while starting or draining (UNAVAILABLE), admit
(RESOURCE_EXHAUSTED beyond ``max_queued_requests`` in flight), validate and
tokenize (INVALID_ARGUMENT naming the field), claim the request id
(ALREADY_EXISTS), then stream one chunk per backend delta and one final
message. The backend's iterator is always closed before the call ends, so a
client cancel, a deadline or a failure aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.tandem.v1 import admin_pb2_grpc, generate_pb2_grpc
from protos.tandem.v1 import generate_pb2 as pb

from .admin import SERVICE_NAME as ADMIN_SERVICE
from .admin import AdminService
from .backend import Backend, GenerateInput, GenerateResult, TokenDelta
from .messages import RequestError, chunk_message, final_message, to_generate_input

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tandem"].full_name  # "tandem.v1.Tandem"
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class ServiceStats:
    """Live counters: requests in flight and finished calls by status code name."""

    in_flight: int = 0
    totals: Counter[str] = field(default_factory=Counter)


class TandemService(generate_pb2_grpc.TandemServicer):
    def __init__(
        self,
        backend: Backend,
        *,
        max_queued_requests: int = 1024,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.backend = backend
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.stats = ServiceStats()
        self.unavailable: str | None = None
        """When set, new calls get UNAVAILABLE with this message (starting, draining)."""
        self._active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        """Returns once no request is in flight."""
        await self._idle.wait()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self._enter()
        try:
            code = await self._generate(request, context)
        except RequestError as e:
            error = e
        except asyncio.CancelledError:
            self._leave(grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:
            log.exception("Generate failed")
            error = RequestError(grpc.StatusCode.INTERNAL, f"request failed: {_short(e)}")
        else:
            self._leave(code)
            return
        self._leave(error.code)  # counted before the client can see the status
        await context.abort(error.code, error.message)

    def _enter(self) -> None:
        self.stats.in_flight += 1
        self._idle.clear()

    def _leave(self, code: grpc.StatusCode) -> None:
        self.stats.in_flight -= 1
        self.stats.totals[code.name] += 1
        if self.stats.in_flight == 0:
            self._idle.set()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> grpc.StatusCode:
        if self.unavailable is not None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, self.unavailable)
        if self.stats.in_flight > self.max_queued_requests:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many requests in flight (limit {self.max_queued_requests}); retry later",
            )
        inp = await to_generate_input(request, self.backend)
        if inp.request_id in self._active:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {inp.request_id!r} is already running"
            )
        self._active.add(inp.request_id)
        try:
            return await self._stream(inp, context)
        finally:
            self._active.discard(inp.request_id)

    def _timeout_s(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        client = math.inf if remaining is None else max(remaining, 0.0)
        return min(client, self.request_timeout_s)

    async def _stream(
        self, inp: GenerateInput, context: grpc.aio.ServicerContext
    ) -> grpc.StatusCode:
        stream: AsyncIterator[TokenDelta | GenerateResult] = self.backend.generate(inp)
        deadline = asyncio.timeout(self._timeout_s(context))
        try:
            async with deadline:
                async for item in stream:
                    if isinstance(item, GenerateResult):
                        await context.write(final_message(inp.request_id, item))
                        return grpc.StatusCode.OK
                    await context.write(chunk_message(item))
            raise RuntimeError("the backend ended the stream without a result")
        except (asyncio.CancelledError, RequestError):
            raise
        except Exception as e:
            if isinstance(e, TimeoutError) and deadline.expired():
                raise RequestError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "deadline exceeded before generation finished",
                ) from None
            if context.cancelled():  # a write failed because the client went away
                raise asyncio.CancelledError from None
            log.exception("request %s failed in the backend", inp.request_id)
            raise RequestError(
                grpc.StatusCode.INTERNAL, f"generation failed: {_short(e)}"
            ) from None
        finally:
            await _close(stream)


def _short(e: Exception, limit: int = 200) -> str:
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


class RouterServer:
    """The router's gRPC server: Tandem, health checking and reflection.

    Owns the backend's lifecycle: ``start()`` starts it (health turns SERVING
    once it is up) and ``stop()`` shuts it down after draining.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_queued_requests: int = 1024,
        request_timeout_s: float = 600.0,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        drain_timeout_s: float = 30.0,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        """With ``tls_cert`` and ``tls_key`` (PEM files) the port serves TLS only."""
        self.backend = backend
        self.drain_timeout_s = drain_timeout_s
        """How long a worker removed by Admin.Scale may drain, by default."""
        self.host = host
        self.service = TandemService(
            backend, max_queued_requests=max_queued_requests, request_timeout_s=request_timeout_s
        )
        self.health = health.aio.HealthServicer()
        self.port = port
        """The bound port (the chosen one once started, when 0 was asked for)."""
        self._max_message_bytes = max_message_bytes
        self._tls = (tls_cert, tls_key) if tls_cert and tls_key else None
        self._server: grpc.aio.Server | None = None
        self._stopped = False
        self._cut = asyncio.Event()

    def _build_server(self) -> grpc.aio.Server:
        """The grpc.aio server, built inside the event loop it will serve."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", self._max_message_bytes),
            ]
        )
        generate_pb2_grpc.add_TandemServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        admin = AdminService(self.backend, self.drain_timeout_s)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        bind = f"{self.host}:{self.port}"
        if self._tls is None:
            port = server.add_insecure_port(bind)
        else:
            cert, key = (Path(p).read_bytes() for p in self._tls)
            port = server.add_secure_port(bind, grpc.ssl_server_credentials([(key, cert)]))
        if port == 0:
            raise OSError(f"could not bind {self.host}:{self.port}")
        self.port = port
        return server

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        """Bind and serve (NOT_SERVING, Generate UNAVAILABLE) while the backend
        starts, then turn SERVING."""
        self.service.unavailable = "the server is starting"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = self._build_server()
        await self._server.start()
        try:
            await self.backend.start()
        except BaseException:
            self._stopped = True
            await self._server.stop(None)
            with contextlib.suppress(Exception):
                await self.backend.shutdown()  # free what a partial start left behind
            raise
        self.service.unavailable = None
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Drain: NOT_SERVING, new calls get UNAVAILABLE, calls in flight get up
        to ``grace_s`` to finish (then they are cancelled); then shut down."""
        if self._stopped or self._server is None:
            return
        self._stopped = True
        self.service.unavailable = "the server is shutting down"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        waits = [
            asyncio.ensure_future(self.service.wait_idle()),
            asyncio.ensure_future(self._cut.wait()),
        ]
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self.service.stats.in_flight:
            log.warning("cancelling %d requests still in flight", self.service.stats.in_flight)
        await self._server.stop(0)  # cancels what is left; their finally blocks abort them
        await self.backend.shutdown()

    def cut_grace(self) -> None:
        """End a drain in progress now (a second SIGINT): what is left is cancelled."""
        self._cut.set()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
