"""TLS on the router's gRPC API (RouterServer over a FakeBackend on
127.0.0.1, certificates made at test time with openssl), and the config that
carries the security settings."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.auth import ApiKeys
from router.client import TandemClient
from router.config import CLUSTER_SECRET_ENV, ServeConfig
from router.service import RouterServer
from tandem_cli.main import main
from tandem_cli.tls_ca import TLS_CA_ENV
from tests.fakes import FakeBackend, FakeTokenizer, RouterInThread

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


def test_cluster_secret_comes_from_the_environment_and_stays_hidden(monkeypatch, tmp_path):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "s3cret-from-env")
    config = ServeConfig.load(None)
    assert config.security.cluster_secret is not None
    assert "s3cret-from-env" not in repr(config)
    assert "s3cret-from-env" not in str(config.model_dump())
    security = config.security.cluster_security()
    assert security.secret == b"s3cret-from-env"
    assert "s3cret" not in repr(config.transfer_config())
    monkeypatch.delenv(CLUSTER_SECRET_ENV)
    generated = ServeConfig.load(None).security.cluster_security().secret
    assert len(generated) == 32  # none configured: one generated, never empty
    # The file's secret wins over the environment's.
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "from-env")
    secrets = tmp_path / "secret.yaml"
    secrets.write_text("security: {cluster_secret: from-file}\n")
    assert ServeConfig.load(secrets).security.cluster_security().secret == b"from-file"


def test_tls_settings_are_checked(tmp_path, cluster_certs):
    mine, _ = cluster_certs
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServeConfig(security={"tls_cert": mine.cert})
    with pytest.raises(ValueError, match="no file"):
        ServeConfig(
            security={"cluster_tls_cert": tmp_path / "nope.pem", "cluster_tls_key": mine.key}
        )
    with pytest.raises(ValueError, match="cluster_tls_ca needs"):
        ServeConfig(security={"cluster_tls_ca": mine.ca})
    config = ServeConfig(
        security={
            "cluster_tls_cert": mine.cert,
            "cluster_tls_key": mine.key,
            "cluster_tls_ca": mine.ca,
        }
    )
    tls = config.security.cluster_security().tls
    assert tls is not None and tls.ca == str(mine.ca)


def test_client_commands_reach_a_tls_router_with_tls_ca(
    cluster_certs, tmp_path, capsys, monkeypatch
):
    mine, other = cluster_certs
    backend = FakeBackend(tokenizer=FakeTokenizer())
    monkeypatch.setenv("TANDEM_ADMIN_KEY", "sk-admin")
    admin = ApiKeys(["sk-admin"])
    with RouterInThread(backend, tls_cert=mine.cert, tls_key=mine.key, admin_keys=admin) as router:
        target = ["--target", router.address]
        ask = ["generate", "hi", *target, "--max-tokens", "3", "--timeout", "10"]
        assert main([*ask, "--tls-ca", str(mine.ca)]) == 0
        out, err = capsys.readouterr()
        assert out == " alpha beta gamma\n" and "3 completion tokens" in err
        for refused in ([], ["--tls-ca", str(other.ca)]):  # plaintext; another CA
            assert main([*ask, *refused]) == 1
            assert "UNAVAILABLE" in capsys.readouterr().err
        # Admin calls go over TLS too: the fake backend cannot scale.
        assert main(["scale", *target, "--decode", "2", "--tls-ca", str(mine.ca)]) == 1
        assert "UNIMPLEMENTED" in capsys.readouterr().err
        dataset = tmp_path / "prompts.jsonl"
        dataset.write_text('{"prompt": "hi", "max_tokens": 2}\n')
        bench = ["bench", *target, "--dataset", str(dataset), "--num-requests", "2"]
        out_dir = tmp_path / "report"
        bench += ["--no-progress", "--no-plots", "--out", str(out_dir)]
        assert main([*bench, "--tls-ca", str(mine.ca)]) == 0
        assert (out_dir / "report.json").is_file()
        assert len(backend.inputs) == 3  # generate once, bench twice


def test_tls_ca_from_the_environment(cluster_certs, monkeypatch, capsys):
    mine, _ = cluster_certs
    with RouterInThread(FakeBackend(tokenizer=FakeTokenizer()), tls_cert=mine.cert,
                        tls_key=mine.key) as router:  # fmt: skip
        monkeypatch.setenv(TLS_CA_ENV, str(mine.ca))
        assert main(["generate", "hi", "--target", router.address, "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out == " alpha beta\n"


def test_a_bad_tls_ca_file_exits_2_naming_it(tmp_path, capsys):
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate")
    for path, why in ((tmp_path / "missing.pem", "No such file"), (not_pem, "no PEM certificate")):
        assert main(["generate", "hi", "--target", "127.0.0.1:1", "--tls-ca", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"--tls-ca {path}" in err and why in err
