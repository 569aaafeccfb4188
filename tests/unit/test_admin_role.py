"""The Admin service's role and bounds: control calls need an admin key (no
key: UNAUTHENTICATED, a user key: PERMISSION_DENIED, none configured: every
call refused), Scale's sizes are checked before the backend sees them, and
a scale Ray cannot place is DEADLINE_EXCEEDED with the router still serving."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from block_index import ReconcileReport
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc, generate_pb2_grpc
from router.auth import ADMIN_KEYS_ENV, ApiKeys, client_metadata
from router.backend import PlacementTimeout
from router.client import build_request
from router.config import PoolsSection, ServeConfig
from router.index_fidelity import ReconcileStats
from router.service import RouterServer, check_keys
from tandem_cli.main import main
from tandem_cli.serve import admin_keys, api_keys, cache_domains
from tests.fakes import FakePools, RouterInThread

pytestmark = pytest.mark.unit

USER, ADMIN = "sk-user", "sk-admin"


@contextlib.asynccontextmanager
async def serving(backend: FakePools, **server_kwargs) -> AsyncIterator[grpc.aio.Channel]:
    server = RouterServer(backend, host="127.0.0.1", port=0, **server_kwargs)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield channel
    finally:
        await server.stop(0)


async def status_of(coro) -> tuple[grpc.StatusCode, str]:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def generate(channel: grpc.aio.Channel, key: str | None) -> grpc.StatusCode:
    stub = generate_pb2_grpc.TandemStub(channel)
    call = stub.Generate(build_request([1, 2], max_tokens=1), metadata=client_metadata(key))
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_control_calls_need_an_admin_key_and_user_calls_a_user_key():
    async def body():
        backend = FakePools(delay_s=0)
        keys = {"api_keys": ApiKeys([USER]), "admin_keys": ApiKeys([ADMIN])}
        async with serving(backend, **keys) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            scale = admin_pb2.ScaleRequest(decode=2)
            for method, request in (
                (admin.Scale, scale),
                (admin.Status, admin_pb2.StatusRequest()),
            ):
                codes = {}
                for who, key in (("none", None), ("stranger", "sk-x"), ("user", USER)):
                    code, _ = await status_of(method(request, metadata=client_metadata(key)))
                    codes[who] = code
                assert codes == {
                    "none": grpc.StatusCode.UNAUTHENTICATED,
                    "stranger": grpc.StatusCode.UNAUTHENTICATED,
                    "user": grpc.StatusCode.PERMISSION_DENIED,
                }
            assert backend.scale_calls == []  # no refused call reached the backend
            reply = await admin.Scale(scale, metadata=client_metadata(ADMIN))
            assert (reply.prefill, reply.decode) == (1, 2)
            status = await admin.Status(admin_pb2.StatusRequest(), metadata=client_metadata(ADMIN))
            assert [w.name for w in status.workers] == ["decode-0"]
            assert await generate(channel, USER) == grpc.StatusCode.OK
            assert await generate(channel, ADMIN) == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(body())


class _CountingReconciler:
    def __init__(self) -> None:
        self.runs = 0
        self.stats = ReconcileStats()  # the router exports it

    async def run(self) -> ReconcileReport:
        self.runs += 1
        return ReconcileReport(1, 3, 1, 0, stale_by_worker={"decode-0": 1})


def test_reconcile_index_needs_an_admin_key():
    async def body():
        backend = FakePools(delay_s=0)
        backend.reconciler = _CountingReconciler()
        keys = {"api_keys": ApiKeys([USER]), "admin_keys": ApiKeys([ADMIN])}
        async with serving(backend, **keys) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            request = admin_pb2.ReconcileIndexRequest()
            codes = {}
            for who, key in (("none", None), ("stranger", "sk-x"), ("user", USER)):
                code, _ = await status_of(
                    admin.ReconcileIndex(request, metadata=client_metadata(key))
                )
                codes[who] = code
            assert codes == {
                "none": grpc.StatusCode.UNAUTHENTICATED,
                "stranger": grpc.StatusCode.UNAUTHENTICATED,
                "user": grpc.StatusCode.PERMISSION_DENIED,
            }
            assert backend.reconciler.runs == 0  # no refused call reached the index
            reply = await admin.ReconcileIndex(request, metadata=client_metadata(ADMIN))
            assert reply.stale_entries == 1 and dict(reply.stale_by_worker) == {"decode-0": 1}
            assert backend.reconciler.runs == 1

    asyncio.run(body())


def test_without_admin_keys_every_control_call_is_refused_and_says_how_to_configure():
    async def body():
        backend = FakePools(delay_s=0)
        async with serving(backend) as channel:  # no key of either kind
            admin = admin_pb2_grpc.AdminStub(channel)
            for key in (None, "anything"):
                code, details = await status_of(
                    admin.Scale(admin_pb2.ScaleRequest(decode=2), metadata=client_metadata(key))
                )
                assert code == grpc.StatusCode.UNAUTHENTICATED
                assert "TANDEM_ADMIN_KEYS" in details and "security.admin_keys" in details
            assert backend.scale_calls == []
            assert await generate(channel, None) == grpc.StatusCode.OK  # serving stays open

    asyncio.run(body())


def test_a_key_may_not_have_both_roles(monkeypatch):
    with pytest.raises(ValueError, match="both an API key and an admin key"):
        RouterServer(FakePools(), api_keys=ApiKeys(["k"]), admin_keys=ApiKeys(["k"]))
    monkeypatch.setenv(ADMIN_KEYS_ENV, "env-admin, ")
    config = ServeConfig(security={"admin_keys": ["cfg-admin"], "api_keys": ["user"]})
    keys = admin_keys(config)
    assert len(keys) == 2 and keys.check("env-admin") and keys.check("cfg-admin")
    check_keys(api_keys(config), keys, cache_domains(config))
    # One check sees every source: a user key in the config that is an admin key
    # from the environment is refused, as one in both config lists is.
    for security in ({"api_keys": ["env-admin"]}, {"api_keys": ["k"], "admin_keys": ["k"]}):
        config = ServeConfig(security=security)
        with pytest.raises(ValueError, match="both an API key and an admin key"):
            check_keys(api_keys(config), admin_keys(config), cache_domains(config))


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"prefill": 4294967295}, "prefill: 4294967295 workers is above pools.max_workers (8)"),
        ({"decode": 9}, "decode: 9 workers is above pools.max_workers (8)"),
        ({"decode": 2, "drain_timeout_s": -1.0}, "drain_timeout_s"),
        ({"decode": 2, "drain_timeout_s": float("nan")}, "drain_timeout_s"),
        ({"decode": 2, "drain_timeout_s": float("inf")}, "drain_timeout_s"),
    ],
)
def test_scale_refuses_out_of_bounds_fields_before_the_backend(request_fields, named):
    async def body():
        backend = FakePools(delay_s=0)
        async with serving(backend, admin_keys=ApiKeys([ADMIN]), max_pool_workers=8) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            request = admin_pb2.ScaleRequest(**request_fields)
            code, details = await status_of(admin.Scale(request, metadata=client_metadata(ADMIN)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert named in details
            assert backend.scale_calls == []
            reply = await admin.Scale(
                admin_pb2.ScaleRequest(decode=8), metadata=client_metadata(ADMIN)
            )
            assert reply.decode == 8

    asyncio.run(body())


def test_a_scale_ray_cannot_place_is_deadline_exceeded_and_serving_goes_on():
    async def body():
        error = PlacementTimeout("1 new decode workers were not placed and started")
        placing = asyncio.Event()
        backend = FakePools(delay_s=0, scale_error=error, placing=placing)
        async with serving(backend, admin_keys=ApiKeys([ADMIN])) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            scale = asyncio.ensure_future(
                status_of(
                    admin.Scale(admin_pb2.ScaleRequest(decode=2), metadata=client_metadata(ADMIN))
                )
            )
            await backend.scaling.wait()  # the scale waits for placement ...
            assert await generate(channel, None) == grpc.StatusCode.OK  # ... requests go on
            assert not scale.done()
            placing.set()  # placement gives up
            code, details = await scale
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "not placed" in details
            assert await generate(channel, None) == grpc.StatusCode.OK

    asyncio.run(body())


def test_pool_sizes_in_the_config_are_bounded_too():
    with pytest.raises(ValueError, match=r"decode: 65 workers is above pools.max_workers \(64\)"):
        PoolsSection(decode=65)
    assert PoolsSection(decode=3, max_workers=3).decode == 3
    assert PoolsSection().placement_timeout_s > 0
    with pytest.raises(ValueError, match=r"decode: 3 workers is above pools.max_workers \(2\)"):
        PoolsSection(max_workers=2).resized(None, 3)


def test_tandem_scale_sends_the_admin_key_from_the_environment(monkeypatch, capsys):
    backend = FakePools(delay_s=0)
    with RouterInThread(backend, admin_keys=ApiKeys([ADMIN])) as router:
        monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
        monkeypatch.setenv("TANDEM_API_KEY", ADMIN)  # the user key variable is not used
        assert main(["scale", "--target", router.address, "--decode", "3"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("TANDEM_ADMIN_KEY", ADMIN)
        assert main(["scale", "--target", router.address, "--decode", "3"]) == 0
        assert "prefill 1, decode 3" in capsys.readouterr().out
    assert backend.scale_calls == [(None, 3, 30.0)]


def test_ray_backend_gives_up_on_placement_after_the_configured_time():
    from router.pool_manager import WorkerHandle
    from router.ray_backend import RayBackend

    backend = RayBackend(ServeConfig(pools={"placement_timeout_s": 7}))
    pool = backend.decode
    pool.workers = [WorkerHandle("d0", "decode", None)]
    backend.members.known = {"d0": pool.workers[0]}
    asked = []

    class Deployment:  # its owner: Ray places nothing in time
        remote = False

        async def call(self, method, *args):
            asked.append((method, *args))
            raise TimeoutError

    backend.deployment = Deployment()
    for _ in range(2):  # the scale lock is free again after a failure
        with pytest.raises(PlacementTimeout, match=r"1 new decode workers .*\(7 s\)"):
            asyncio.run(backend.scale(None, 2, 0.0))
    assert asked == [("grow", "decode", 2, 7.0)] * 2
    assert [w.name for w in pool.workers] == ["d0"]
