"""Internal gRPC calls prove the cluster secret by a MAC, never by sending it
(net/call_auth.py): who gets through a real grpc.aio server with the
SecretInterceptor, asserted by status, the audience (the server's own
address) and the bounded replay cache."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from net.call_auth import AUTH_KEY, CallSigner, CallVerifier
from net.security import ClusterSecurity

pytestmark = pytest.mark.unit

SECRET = b"the cluster secret"
SERVICE = "tandem.test.Echo"
ECHO = f"/{SERVICE}/Echo"
OTHER = f"/{SERVICE}/Other"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
HERE = "10.0.0.1:5000"  # an audience for the verifier-only tests


class Echo:
    """A server with two unary methods behind the SecretInterceptor; counts the
    requests its handlers saw."""

    def __init__(self) -> None:
        self.handled = 0

    async def _echo(self, request: bytes, context) -> bytes:
        self.handled += 1
        return request

    async def start(self) -> str:
        auth = ClusterSecurity(SECRET).interceptor()
        self.server = grpc.aio.server(interceptors=[auth])
        methods = {
            name: grpc.unary_unary_rpc_method_handler(self._echo) for name in ("Echo", "Other")
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, methods),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        address = f"127.0.0.1:{port}"
        auth.bind(address)
        await self.server.start()
        return address


async def _call(channel: grpc.aio.Channel, method: str = ECHO, metadata=None) -> grpc.StatusCode:
    try:
        reply = await channel.unary_unary(method)(b"ping", timeout=10, metadata=metadata)
    except grpc.aio.AioRpcError as e:
        return e.code()
    assert reply == b"ping"
    return grpc.StatusCode.OK


def _run(body) -> tuple[object, int]:
    """``body(address)`` against a fresh Echo server; (its result, requests handled)."""

    async def main():
        echo = Echo()
        address = await echo.start()
        try:
            return await body(address), echo.handled
        finally:
            await echo.server.stop(None)

    return asyncio.run(main())


def _signed_channel(address: str, signer: CallSigner) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, interceptors=signer.interceptors())


def test_the_right_secret_passes_and_the_secret_is_not_on_the_wire():
    async def body(address):
        async with ClusterSecurity(SECRET).channel(address) as channel:
            return await _call(channel), await _call(channel, OTHER)

    assert _run(body) == ((grpc.StatusCode.OK, grpc.StatusCode.OK), 2)
    key, value = CallSigner(SECRET, HERE).sign(ECHO)
    assert key == AUTH_KEY
    assert SECRET.hex() not in value and SECRET.decode() not in value


def test_a_wrong_secret_is_refused():
    async def body(address):
        async with ClusterSecurity(b"the cluster secreT").channel(address) as channel:
            return await _call(channel)

    assert _run(body) == (UNAUTH, 0)


def test_a_call_without_metadata_is_refused():
    async def body(address):
        async with grpc.aio.insecure_channel(address) as channel:
            return await _call(channel)

    assert _run(body) == (UNAUTH, 0)


@pytest.mark.parametrize("offset_s", [-120.0, 120.0])
def test_a_timestamp_outside_the_skew_window_is_refused(offset_s):
    async def body(address):
        signer = CallSigner(SECRET, address, clock=lambda: time.time() + offset_s)
        async with _signed_channel(address, signer) as channel:
            return await _call(channel)

    assert _run(body) == (UNAUTH, 0)


def test_a_replayed_call_is_refused():
    async def body(address):
        recorded = (CallSigner(SECRET, address).sign(ECHO),)
        async with grpc.aio.insecure_channel(address) as channel:
            return await _call(channel, metadata=recorded), await _call(channel, metadata=recorded)

    assert _run(body) == ((grpc.StatusCode.OK, UNAUTH), 1)


def test_a_signature_for_one_method_is_refused_on_another():
    async def body(address):
        recorded = (CallSigner(SECRET, address).sign(ECHO),)
        async with grpc.aio.insecure_channel(address) as channel:
            return await _call(channel, OTHER, metadata=recorded)

    assert _run(body) == (UNAUTH, 0)


def test_a_signature_for_one_server_is_refused_by_another_with_the_same_secret():
    """A sniffer who replays a call's MAC at another worker gets nothing: the
    MAC names the address dialled, the server checks its own."""

    async def body(address):
        elsewhere = CallSigner(SECRET, "127.0.0.1:1").sign(ECHO)  # made for another server
        own = CallSigner(SECRET, address).sign(ECHO)
        async with grpc.aio.insecure_channel(address) as channel:
            return await _call(channel, metadata=(elsewhere,)), await _call(
                channel, metadata=(own,)
            )

    assert _run(body) == ((UNAUTH, grpc.StatusCode.OK), 1)
    other, mine = CallVerifier(SECRET, "10.0.0.2:5000"), CallVerifier(SECRET, HERE)
    signed = (CallSigner(SECRET, HERE).sign(ECHO),)
    assert "address" in other.check(ECHO, signed)
    assert mine.check(ECHO, signed) is None


def test_a_server_that_does_not_know_its_address_refuses_every_call():
    signed = (CallSigner(SECRET, HERE).sign(ECHO),)
    assert "address" in CallVerifier(SECRET).check(ECHO, signed)


@pytest.mark.parametrize("value", ["", "v2", "v2.x.y.z", "v1.1.2.3", "v2.1.2.3.4"])
def test_malformed_metadata_is_refused(value):
    assert CallVerifier(SECRET, HERE).check(ECHO, ((AUTH_KEY, value),)) is not None


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_full_replay_cache_forgets_its_oldest_and_refuses_what_it_forgot():
    clock = Clock()
    signer = CallSigner(SECRET, HERE, clock)
    verifier = CallVerifier(SECRET, HERE, clock, skew_s=60, max_nonces=2)
    calls = []
    for _ in range(3):
        calls.append((signer.sign(ECHO),))
        clock.now += 1
    assert [verifier.check(ECHO, c) for c in calls] == [None, None, None]
    # The first was forgotten to make room: replaying it is refused all the same.
    assert "too old" in verifier.check(ECHO, calls[0])
    assert "replayed" in verifier.check(ECHO, calls[2])
    assert verifier.check(ECHO, (signer.sign(ECHO),)) is None


def test_nonces_past_the_window_are_forgotten_and_their_calls_refused_as_stale():
    clock = Clock()
    signer = CallSigner(SECRET, HERE, clock)
    verifier = CallVerifier(SECRET, HERE, clock, skew_s=60, max_nonces=4)
    first = (signer.sign(ECHO),)
    assert verifier.check(ECHO, first) is None
    clock.now += 61
    assert "skew" in verifier.check(ECHO, first)
    for _ in range(4):  # the cache has room again: nothing stale is kept
        assert verifier.check(ECHO, (signer.sign(ECHO),)) is None
