"""TLS on the router's gRPC API (RouterServer over a FakeBackend on
127.0.0.1, certificates made at test time with openssl), and the config that
carries the security settings."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.client import TandemClient
from router.service import RouterServer
from tandem_cli.config import CLUSTER_SECRET_ENV, ServeConfig
from tests.fakes import FakeBackend, FakeTokenizer

pytestmark = pytest.mark.integration


def test_tls_router_serves_tls_clients_and_refuses_plaintext(cluster_certs):
    mine, other = cluster_certs

    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        server = RouterServer(backend, port=0, tls_cert=mine.cert, tls_key=mine.key)
        await server.start()
        try:
            async with TandemClient(
                server.address, 10, root_certificates=mine.ca.read_bytes()
            ) as c:
                done = await c.complete("hello", max_tokens=3)
            assert done.finish_reason == "length"
            assert len(done.token_ids) == 3
            for client in (
                TandemClient(server.address, 5),  # plaintext
                TandemClient(server.address, 5, root_certificates=other.ca.read_bytes()),
            ):
                async with client:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await client.complete("hello", max_tokens=3)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len(backend.inputs) == 1  # only the TLS client's request got in
        finally:
            await server.stop(0)

    asyncio.run(body())


def test_cluster_secret_comes_from_the_environment_and_stays_hidden(monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "s3cret-from-env")
    config = ServeConfig.load(None)
    assert config.cluster_secret is not None
    assert "s3cret-from-env" not in repr(config)
    assert "s3cret-from-env" not in str(config.model_dump())
    security = config.cluster_security()
    assert security.secret == b"s3cret-from-env"
    assert "s3cret" not in repr(config.transfer_config())
    monkeypatch.delenv(CLUSTER_SECRET_ENV)
    assert ServeConfig.load(None).cluster_security().secret == b""


def test_tls_settings_are_checked(tmp_path, cluster_certs):
    mine, _ = cluster_certs
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServeConfig(tls_cert=mine.cert)
    with pytest.raises(ValueError, match="no file"):
        ServeConfig(cluster_tls_cert=tmp_path / "nope.pem", cluster_tls_key=mine.key)
    with pytest.raises(ValueError, match="cluster_tls_ca needs"):
        ServeConfig(cluster_tls_ca=mine.ca)
    config = ServeConfig(
        cluster_tls_cert=mine.cert, cluster_tls_key=mine.key, cluster_tls_ca=mine.ca
    )
    tls = config.cluster_security().tls
    assert tls is not None and tls.ca == str(mine.ca)
