"""API keys: one check for the gRPC API (an interceptor) and the HTTP front.

Clients send ``authorization: Bearer <key>`` (gRPC metadata or HTTP header).
Keys come from the config (``security.api_keys``, ``security.api_keys_file``) and the
``TANDEM_API_KEYS`` environment variable (comma-separated), never from the
command line. With no key configured, authentication is off.

Control calls (the ``tandem.v1.Admin`` service) need an admin key, from
``security.admin_keys``, ``security.admin_keys_file`` and ``TANDEM_ADMIN_KEYS``;
no user key is one. Without one they are refused even when no key of either
kind is configured: no key gets UNAUTHENTICATED, a user key PERMISSION_DENIED.

Health checking (``grpc.health.v1.Health`` and HTTP ``/health``) stays open so
that load balancers and orchestrators need no key. Keys are never logged;
a presented key is compared with every configured key in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

KEYS_ENV = "TANDEM_API_KEYS"
"""Server side: comma-separated keys the router accepts (added to the config's)."""
CLIENT_KEY_ENV = "TANDEM_API_KEY"
"""Client side: the key ``TandemClient``, ``tandem generate`` and ``tandem bench`` send."""
ADMIN_KEYS_ENV = "TANDEM_ADMIN_KEYS"
"""Server side: comma-separated admin keys the router accepts on control calls."""
CLIENT_ADMIN_KEY_ENV = "TANDEM_ADMIN_KEY"
"""Client side: the admin key ``tandem scale`` sends."""
OPEN_GRPC_SERVICES = ("/grpc.health.v1.Health/",)
ADMIN_GRPC_SERVICES = ("/tandem.v1.Admin/",)
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>'"
ADMIN_UNAUTHENTICATED_MESSAGE = (
    "missing or invalid admin key: control calls need 'authorization: Bearer <admin key>'"
)
NOT_AN_ADMIN_KEY_MESSAGE = "an API key is not an admin key: control calls need an admin key"
NO_ADMIN_KEYS_HINT = (
    "; this router has no admin key: set TANDEM_ADMIN_KEYS, security.admin_keys_file "
    "or security.admin_keys"
)


def check_private_file(path: str | Path, setting: str) -> None:
    """ValueError naming ``setting`` when the file at ``path`` grants its group
    or others any access (it holds keys or a token: mode 0600 or 0400)."""
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o077:
        raise ValueError(
            f"{setting} {path} is readable by group or others (mode {mode:04o}): "
            f"it holds secrets; chmod 600 it"
        )


def read_keys_file(path: str | Path, setting: str = "security.api_keys_file") -> list[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped.
    ValueError when group or others have access to the file (``setting``
    names it in the message)."""
    check_private_file(path, setting)
    lines = Path(path).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def keys_from_env(environ: dict[str, str] | None = None, name: str = KEYS_ENV) -> list[str]:
    value = (os.environ if environ is None else environ).get(name, "")
    return [k.strip() for k in value.split(",") if k.strip()]


def bearer_token(header: str | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeys:
    """The set of accepted keys. Only SHA-256 digests are kept in memory."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests = [key_digest(k) for k in dict.fromkeys(keys) if k]

    @classmethod
    def load(
        cls,
        keys: Iterable[str] = (),
        keys_file: str | Path | None = None,
        environ: dict[str, str] | None = None,
        env_name: str = KEYS_ENV,
        file_setting: str = "security.api_keys_file",
    ) -> ApiKeys:
        """Keys from the config, the keys file (``file_setting`` names it in
        errors) and the ``env_name`` variable (``TANDEM_API_KEYS``;
        ``TANDEM_ADMIN_KEYS`` for admin keys), together."""
        all_keys = list(keys)
        if keys_file is not None:
            all_keys += read_keys_file(keys_file, file_setting)
        return cls(all_keys + keys_from_env(environ, env_name))

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self)} keys)"

    def check(self, key: str | None) -> bool:
        """Whether ``key`` is accepted (always, when authentication is off)."""
        if not self._digests:
            return True
        if key is None:
            return False
        presented = key_digest(key)
        found = False
        for digest in self._digests:  # no early exit: the time does not depend on which key
            found |= hmac.compare_digest(presented, digest)
        return found

    def check_header(self, authorization: str | None) -> bool:
        return self.check(bearer_token(authorization))

    def shares_a_key_with(self, other: ApiKeys) -> bool:
        """Whether a key is in both sets (a user key must never be an admin key)."""
        return bool(set(self._digests) & set(other._digests))

    def identity(self, authorization: str | None) -> bytes | None:
        """The digest of the key an accepted ``authorization`` header carries (what
        per-key limits count by); None when authentication is off or the key is refused."""
        key = bearer_token(authorization)
        if not self._digests or key is None or not self.check(key):
            return None
        return key_digest(key)


def key_digest(key: str) -> bytes:
    """The SHA-256 digest of an API key: what is kept of it in memory."""
    return hashlib.sha256(key.encode()).digest()


def client_metadata(
    api_key: str | None = None, env_name: str = CLIENT_KEY_ENV
) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``api_key``, else ``$TANDEM_API_KEY`` (or the
    ``env_name`` variable: ``TANDEM_ADMIN_KEY`` for control calls); empty if neither."""
    key = api_key if api_key is not None else os.environ.get(env_name)
    return (("authorization", f"Bearer {key}"),) if key else ()


def metadata_value(metadata: Iterable[tuple[str, str]] | None, name: str) -> str | None:
    """The first value of ``name`` in gRPC call metadata, else None."""
    return next((value for key, value in metadata or () if key == name), None)


@dataclass(frozen=True)
class Refusal:
    """Why a call is refused: its status and message."""

    code: grpc.StatusCode
    message: str


def admin_refusal(admins: ApiKeys, users: ApiKeys, authorization: str | None) -> Refusal | None:
    """None when ``authorization`` carries an admin key; else UNAUTHENTICATED, or
    PERMISSION_DENIED for a valid user key. With no admin key configured every
    control call is refused, and the message says how to configure one."""
    key = bearer_token(authorization)
    if key is not None and admins.enabled and admins.check(key):
        return None
    hint = "" if admins.enabled else NO_ADMIN_KEYS_HINT
    if key is not None and users.enabled and users.check(key):
        return Refusal(grpc.StatusCode.PERMISSION_DENIED, NOT_AN_ADMIN_KEY_MESSAGE + hint)
    return Refusal(grpc.StatusCode.UNAUTHENTICATED, ADMIN_UNAUTHENTICATED_MESSAGE + hint)


def client_headers(api_key: str | None = None) -> dict[str, str]:
    """HTTP headers carrying ``api_key``, else ``$TANDEM_API_KEY``."""
    return dict(client_metadata(api_key))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key with UNAUTHENTICATED (health checks pass),
    and control calls (Admin) without an admin key (``admin_refusal``).

    ``on_refused`` is told the method name of each refused call (for metrics).
    """

    def __init__(
        self,
        keys: ApiKeys,
        on_refused: Callable[[str], None] | None = None,
        admin_keys: ApiKeys | None = None,
    ) -> None:
        self.keys = keys
        self.admin_keys = admin_keys or ApiKeys()
        self.on_refused = on_refused

    def refusal(self, method: str, authorization: str | None) -> Refusal | None:
        """Why a call of ``method`` with this ``authorization`` is refused; None: it is not."""
        if method.startswith(ADMIN_GRPC_SERVICES):
            return admin_refusal(self.admin_keys, self.keys, authorization)
        if not self.keys.enabled or method.startswith(OPEN_GRPC_SERVICES):
            return None
        if self.keys.check_header(authorization):
            return None
        return Refusal(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        authorization = metadata_value(details.invocation_metadata, "authorization")
        refusal = self.refusal(method, authorization)
        if refusal is None:
            return await continuation(details)
        if self.on_refused is not None:
            self.on_refused(method)
        handler = await continuation(details)
        return _refusing(handler, refusal)


def _refusing(handler: grpc.RpcMethodHandler | None, refusal: Refusal) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with ``refusal``."""

    async def abort_unary(request, context: grpc.aio.ServicerContext):
        await context.abort(refusal.code, refusal.message)

    async def abort_stream(request, context: grpc.aio.ServicerContext):
        await context.abort(refusal.code, refusal.message)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(abort_unary)
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort_unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, des, ser)
    return grpc.unary_unary_rpc_method_handler(abort_unary, des, ser)
