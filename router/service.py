"""The public gRPC API (``tandem.v1.Tandem``) over a ``Backend``.

Requests from this API and from the HTTP front (router/http/) share one
``Lifecycle`` (router/lifecycle.py). One ``Generate`` call, in order:
refuse while starting or draining (UNAVAILABLE), admit (RESOURCE_EXHAUSTED
beyond ``limits.max_queued_requests`` in flight), validate and tokenize
(INVALID_ARGUMENT naming the field), claim the request id (ALREADY_EXISTS),
then stream one chunk per backend delta and one final message (a slow
client's are bounded: router/backpressure.py). The
backend's iterator is always closed before the call ends, so a client
cancel, a deadline or a failure aborts the request on the workers.
``GetModelInfo`` names the served model and its limits (router/model_info.py;
UNAVAILABLE while starting). Calls without a valid API key (when keys are
set) get UNAUTHENTICATED, on both methods; the Admin service (router/admin.py)
needs an admin key (router/auth.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.tandem.v1 import admin_pb2_grpc, generate_pb2_grpc
from protos.tandem.v1 import generate_pb2 as pb

from .admin import MAX_POOL_WORKERS, AdminService
from .admin import SERVICE_NAME as ADMIN_SERVICE
from .auth import ApiKeyInterceptor, ApiKeys, metadata_value
from .backend import Backend, GenerateResult, ReconcilesIndex
from .backpressure import SlowClient
from .grpc_limits import GenerateSizeInterceptor
from .http import FrontState, HttpFront
from .index_fidelity import ReconcileCollector
from .lifecycle import STARTING, Call, Lifecycle, ServiceStats, short
from .limits import RequestLimits, generate_message_limit, max_token_bytes
from .messages import RequestError, chunk_message, final_message, to_generate_input
from .metrics import RouterMetrics
from .model_info import ModelInfo
from .tenancy import CacheDomains

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tandem"].full_name  # "tandem.v1.Tandem"
MAX_MESSAGE_BYTES = 64 << 20
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"


@dataclass(frozen=True)
class HttpSettings:
    """The HTTP front (OpenAI-compatible API and /metrics) beside the gRPC API."""

    host: str
    port: int  # 0 picks a free one
    model_name: str  # what /v1/models lists and requests must name
    chat_template_file: str | Path | None = None
    tls_cert: Path | None = None  # with tls_key (PEM files): HTTPS only
    tls_key: Path | None = None


class TandemService(generate_pb2_grpc.TandemServicer):
    def __init__(self, lifecycle: Lifecycle, keys: ApiKeys | None = None) -> None:
        self.lifecycle = lifecycle
        self.backend = lifecycle.backend
        self.keys = keys or ApiKeys()

    @property
    def stats(self) -> ServiceStats:
        return self.lifecycle.stats

    @property
    def unavailable(self) -> str | None:
        """Set while starting or draining: new calls get UNAVAILABLE."""
        return self.lifecycle.unavailable

    @property
    def max_queued_requests(self) -> int:
        return self.lifecycle.max_queued_requests

    @max_queued_requests.setter
    def max_queued_requests(self, value: int) -> None:
        self.lifecycle.max_queued_requests = value

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        call = self.lifecycle.begin("grpc")
        try:
            await self._generate(call, request, context)
        except RequestError as e:
            error = e
        except asyncio.CancelledError:
            call.finish(grpc.StatusCode.CANCELLED)
            raise
        except Exception as e:
            log.exception("Generate failed")
            error = RequestError(grpc.StatusCode.INTERNAL, f"request failed: {short(e)}")
        else:
            call.finish(grpc.StatusCode.OK)
            return
        call.finish(error.code)  # counted before the client can see the status
        await context.abort(error.code, error.message)

    async def _generate(
        self, call: Call, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        authorization = metadata_value(context.invocation_metadata(), "authorization")
        call.admit(self.keys.identity(authorization))
        tenant = self.lifecycle.cache_domains.tenant(authorization)
        inp = await to_generate_input(
            request, self.backend, call.start, tenant, self.lifecycle.limits
        )
        call.claim(inp)
        timeout_s = self.lifecycle.timeout_s(context.time_remaining())
        async with call.deadline(timeout_s), contextlib.aclosing(call.stream()) as items:
            async for item in items:
                if isinstance(item, GenerateResult):
                    message = final_message(inp.request_id, item)
                else:
                    message = chunk_message(item)
                try:
                    async with call.unread.writing():
                        await context.write(message)  # waits for the client's HTTP/2 window
                except SlowClient as e:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
                except Exception:
                    if context.cancelled():  # the client went away
                        raise asyncio.CancelledError from None
                    raise

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        if self.lifecycle.unavailable == STARTING:  # the limits are not known yet
            await context.abort(grpc.StatusCode.UNAVAILABLE, STARTING)
        return ModelInfo.of(self.backend).to_proto()


@dataclass(frozen=True)
class Settled:
    """What a router serves as once its backend joined its deployment."""

    model_name: str  # what /v1/models lists and requests must name
    cache_domains: CacheDomains


def check_keys(api_keys: ApiKeys, admin_keys: ApiKeys, domains: CacheDomains) -> None:
    """Raises ValueError when a key is both an API key and an admin key, or when
    each API key should be a cache domain and there are none."""
    if api_keys.shares_a_key_with(admin_keys):
        raise ValueError("a key is both an API key and an admin key: give each role its own")
    if domains.mode == "per_api_key" and not api_keys.enabled:
        raise ValueError("security.cache_domain per_api_key needs API keys; none is configured")


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
        api_keys: ApiKeys | None = None,
        admin_keys: ApiKeys | None = None,
        cache_domains: CacheDomains | None = None,
        max_pool_workers: int = MAX_POOL_WORKERS,
        http: HttpSettings | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        limits: RequestLimits | None = None,
        settle: Callable[[], Settled] | None = None,
    ) -> None:
        """With ``tls_cert`` and ``tls_key`` (PEM files) the port serves TLS only.
        ``admin_keys`` open the Admin service (none: it refuses every call); no key
        may be both an API key and an admin key. ``max_pool_workers`` bounds the
        sizes Admin.Scale accepts. ``settle``, called once the backend started,
        gives the model name and cache domains of what it joined (a named
        deployment's, not this router's own config's). Raises ValueError for
        keys that do not fit."""
        self._settle = settle
        self.backend = backend
        self.api_keys = api_keys or ApiKeys()
        self.admin_keys = admin_keys or ApiKeys()
        domains = cache_domains or CacheDomains()
        check_keys(self.api_keys, self.admin_keys, domains)
        self.max_pool_workers = max_pool_workers
        self.drain_timeout_s = drain_timeout_s
        """How long a worker removed by Admin.Scale may drain, by default."""
        self.host = host
        self.metrics = RouterMetrics()
        if isinstance(backend, ReconcilesIndex):  # what its index reconciles find
            self.metrics.registry.register(ReconcileCollector(backend.reconciler.stats))
        self.lifecycle = Lifecycle(
            backend,
            max_queued_requests=max_queued_requests,
            request_timeout_s=request_timeout_s,
            metrics=self.metrics,
            cache_domains=domains,
            limits=limits,
        )
        self.service = TandemService(self.lifecycle, self.api_keys)
        self.http: HttpFront | None = None
        if http is not None:
            state = FrontState(
                self.lifecycle, self.api_keys, http.model_name, http.chat_template_file
            )
            self.http = HttpFront(state, http.host, http.port, http.tls_cert, http.tls_key)
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
            interceptors=[
                ApiKeyInterceptor(self.api_keys, self._refused, self.admin_keys),
                GenerateSizeInterceptor(GENERATE_METHOD, self.generate_message_limit),
            ],
            options=[
                ("grpc.max_receive_message_length", self._max_message_bytes),
                ("grpc.max_send_message_length", self._max_message_bytes),
            ],
        )
        generate_pb2_grpc.add_TandemServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        admin = AdminService(self.backend, self.drain_timeout_s, self.max_pool_workers)
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

    def generate_message_limit(self) -> int:
        """The largest Generate request accepted: what max_model_len tokens can use
        (router/limits.py), within ``limits.max_message_mb``."""
        backend = self.backend
        if self.lifecycle.unavailable == STARTING or not backend.max_model_len:
            return self._max_message_bytes  # such calls get UNAVAILABLE anyway
        per_token = max_token_bytes(backend.tokenizer)
        limits, cap = self.lifecycle.limits, self._max_message_bytes
        return generate_message_limit(backend.max_model_len, per_token, limits, cap)

    def _refused(self, method: str) -> None:
        self.metrics.auth_refused.inc()
        if method == GENERATE_METHOD:
            self.metrics.requests.labels("grpc", "UNAUTHENTICATED").inc()

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
        self.lifecycle.unavailable = STARTING
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = self._build_server()
        await self._server.start()
        try:
            if self.http is not None:
                await self.http.start()
            await self.backend.start()
            if self._settle is not None:
                self._take(self._settle())
        except BaseException:
            self._stopped = True
            await self._server.stop(None)
            if self.http is not None:
                await self.http.stop()
            with contextlib.suppress(Exception):
                await self.backend.shutdown()  # free what a partial start left behind
            raise
        self.lifecycle.unavailable = None
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _take(self, settled: Settled) -> None:
        check_keys(self.api_keys, self.admin_keys, settled.cache_domains)
        self.lifecycle.cache_domains = settled.cache_domains
        if self.http is not None:
            self.http.state.model_name = settled.model_name

    async def stop(self, grace_s: float = 30.0) -> None:
        """Drain: NOT_SERVING, new calls get UNAVAILABLE, calls in flight get up
        to ``grace_s`` to finish (then they are cancelled); then shut down."""
        if self._stopped or self._server is None:
            return
        self._stopped = True
        self.lifecycle.unavailable = "the server is shutting down"
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        waits = [
            asyncio.ensure_future(self.lifecycle.wait_idle()),
            asyncio.ensure_future(self._cut.wait()),
        ]
        await asyncio.wait(waits, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self.lifecycle.stats.in_flight:
            log.warning("cancelling %d requests still in flight", self.lifecycle.stats.in_flight)
        await self._server.stop(0)  # cancels what is left; their finally blocks abort them
        if self.http is not None:
            await self.http.stop()  # closes the streams left; their finally blocks abort them
        await self.backend.shutdown()

    def cut_grace(self) -> None:
        """End a drain in progress now (a second SIGINT): what is left is cancelled."""
        self._cut.set()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
