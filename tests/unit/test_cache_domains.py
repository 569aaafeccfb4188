"""Prefix-cache domains (router/tenancy.py): the ``cache_salt`` field on both
fronts and ``security.cache_domain``, seen in the ``GenerateInput.cache_salt``
the backend receives."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import httpx
import pytest

from net.security import ClusterSecurity
from protos.tandem.v1 import generate_pb2_grpc
from router.auth import ApiKeys, client_metadata, key_digest
from router.client import build_request
from router.config import SecuritySection, ServeConfig
from router.service import HttpSettings, RouterServer
from router.tenancy import MAX_CACHE_SALT_CHARS, CacheDomains, derive_salt, salt_key
from tandem_cli.serve import cache_domains
from tests.fakes import FakeBackend, FakeTokenizer

pytestmark = pytest.mark.unit

MODEL = "fake-model"
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


K = salt_key(ClusterSecurity(b"cluster-secret"))


def test_the_default_domain_keeps_the_hashes_of_old():
    assert derive_salt(K, b"", None) == b""
    assert derive_salt(K, b"", "") == b""
    assert CacheDomains().tenant(None).salt(None) == b""


def test_salts_are_stable_per_domain_and_differ_between_domains():
    a, b = key_digest(KEY_A), key_digest(KEY_B)
    assert a != b and KEY_A.encode() not in a  # a digest, never the key
    domains = [(b"", "s"), (b"", "t"), (a, None), (b, None), (a, "s"), (b, "s")]
    salts = [derive_salt(K, tenant, salt) for tenant, salt in domains]
    assert all(salts) and len(set(salts)) == len(domains)
    assert salts == [derive_salt(K, tenant, salt) for tenant, salt in domains]
    # The parts are length-prefixed: moving bytes from the tenant to the salt is
    # another domain.
    assert derive_salt(K, b"ab", "c") != derive_salt(K, b"a", "bc")


def test_salts_are_keyed_by_the_cluster_secret():
    """A salt on the wire cannot be matched to a guessed key or salt string
    without the secret; routers that share a configured secret agree."""
    tenant = key_digest(KEY_A)
    one = CacheDomains.of("per_api_key", ClusterSecurity(b"secret-one"))
    other = CacheDomains.of("per_api_key", ClusterSecurity(b"secret-two"))
    again = CacheDomains.of("per_api_key", ClusterSecurity(b"secret-one"))
    for client_salt in (None, "s"):
        salt = one.tenant(f"Bearer {KEY_A}").salt(client_salt)
        assert salt != other.tenant(f"Bearer {KEY_A}").salt(client_salt)
        assert salt == again.tenant(f"Bearer {KEY_A}").salt(client_salt)
        # Not the unkeyed digest of the public inputs.
        unkeyed = hashlib.blake2b(digest_size=16, person=b"tandem-salt-v1")
        for part in (tenant, (client_salt or "").encode()):
            unkeyed.update(len(part).to_bytes(4, "big") + part)
        assert salt != unkeyed.digest()
    assert one.tenant(None).salt(None) == other.tenant(None).salt(None) == b""


def test_routers_sharing_a_configured_secret_derive_the_same_salts():
    def salt(config: ServeConfig, client_salt: str) -> bytes:
        return cache_domains(config).tenant(f"Bearer {KEY_A}").salt(client_salt)

    def config(secret: str | None) -> ServeConfig:
        security: dict = {"cache_domain": "per_api_key", "api_keys": [KEY_A]}
        if secret is not None:
            security["cluster_secret"] = secret
        return ServeConfig.model_validate({"engine": {"model": "m"}, "security": security})

    assert salt(config("shared-secret"), "s") == salt(config("shared-secret"), "s")
    assert salt(config("shared-secret"), "s") != salt(config("another-secret"), "s")
    generated = config(None)  # a secret of its own, the same for the router's life
    assert salt(generated, "s") == salt(generated, "s") != salt(config(None), "s")


def test_the_tenant_comes_from_the_key_only_when_each_key_is_a_domain():
    assert CacheDomains("shared").tenant(f"Bearer {KEY_A}").id == b""
    per_key = CacheDomains("per_api_key")
    assert per_key.tenant(f"Bearer {KEY_A}").id == key_digest(KEY_A)
    assert per_key.tenant(f"bearer  {KEY_A} ").id == key_digest(KEY_A)
    assert per_key.tenant(None).id == b""


def test_each_key_a_domain_needs_keys():
    with pytest.raises(ValueError, match="per_api_key needs API keys"):
        RouterServer(FakeBackend(), cache_domains=CacheDomains("per_api_key"))
    assert SecuritySection(cache_domain="per_api_key").cache_domain == "per_api_key"


async def _grpc_salt(
    stub: generate_pb2_grpc.TandemStub, key: str, salt: str | None, backend: FakeBackend
) -> bytes:
    request = build_request([1, 2, 3], max_tokens=1, cache_salt=salt)
    async for _ in stub.Generate(request, metadata=client_metadata(key)):
        pass
    return backend.inputs[-1].cache_salt


async def _http_salt(url: str, key: str, salt: str | None, backend: FakeBackend) -> bytes:
    body: dict = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
    assert reply.status_code == 200, reply.text
    return backend.inputs[-1].cache_salt


async def _salts_of_both_fronts(mode: str) -> tuple[dict, dict]:
    backend = FakeBackend(delay_s=0)
    server = RouterServer(
        backend,
        host="127.0.0.1",
        port=0,
        api_keys=ApiKeys([KEY_A, KEY_B]),
        cache_domains=CacheDomains(mode, K),  # type: ignore[arg-type]
        http=HttpSettings(host="127.0.0.1", port=0, model_name=MODEL),
    )
    await server.start()
    cases = [(KEY_A, None), (KEY_B, None), (KEY_A, "s"), (KEY_B, "s")]
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = generate_pb2_grpc.TandemStub(channel)
            by_grpc = {c: await _grpc_salt(stub, *c, backend) for c in cases}
        assert server.http is not None
        by_http = {c: await _http_salt(server.http.url, *c, backend) for c in cases}
    finally:
        await server.stop(0)
    return by_grpc, by_http


def test_per_api_key_gives_each_key_its_own_domain_on_both_fronts():
    by_grpc, by_http = asyncio.run(_salts_of_both_fronts("per_api_key"))
    assert by_grpc == by_http  # both fronts put a request in the same domain
    assert all(by_grpc.values()) and len(set(by_grpc.values())) == 4
    assert by_grpc[(KEY_A, None)] == derive_salt(K, key_digest(KEY_A), None)


def test_shared_domains_differ_by_salt_only():
    by_grpc, by_http = asyncio.run(_salts_of_both_fronts("shared"))
    assert by_grpc == by_http
    assert by_grpc[(KEY_A, None)] == by_grpc[(KEY_B, None)] == b""
    assert by_grpc[(KEY_A, "s")] == by_grpc[(KEY_B, "s")] == derive_salt(K, b"", "s")


BAD_SALTS = [
    ("", "cache_salt must be a non-empty string"),
    ("x" * (MAX_CACHE_SALT_CHARS + 1), f"the limit is {MAX_CACHE_SALT_CHARS}"),
]


@pytest.mark.parametrize(("salt", "message"), BAD_SALTS)
def test_a_bad_cache_salt_is_invalid_argument_naming_the_field(salt, message):
    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer(), delay_s=0)
        server = RouterServer(
            backend,
            host="127.0.0.1",
            port=0,
            http=HttpSettings(host="127.0.0.1", port=0, model_name=MODEL),
        )
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(build_request("hi", cache_salt=salt)):
                        pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cache_salt" in info.value.details() and message in info.value.details()
            assert server.http is not None
            async with httpx.AsyncClient() as client:
                for value in (salt, 5, ["s"]):
                    body = {"model": MODEL, "prompt": "hi", "cache_salt": value}
                    reply = await client.post(f"{server.http.url}/v1/completions", json=body)
                    assert reply.status_code == 400, reply.text
                    assert "cache_salt" in reply.json()["error"]["message"]
            assert backend.inputs == []
        finally:
            await server.stop(0)

    asyncio.run(body())
