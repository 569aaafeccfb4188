"""TLS on the HTTP front: with a certificate an HTTPS client that trusts its
CA is served, a plain-HTTP request gets no answer, and the config gives the
gRPC API's certificate to the HTTP front unless it has its own."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import pytest

from router.config import ServeConfig
from router.service import HttpSettings, RouterServer
from tandem_cli.serve import http_settings
from tests.fakes import FakeBackend, FakeTokenizer
from tests.http_helpers import MODEL
from tests.tls_certs import make_certs, openssl_available

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not openssl_available(), reason="the openssl command is not installed"),
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("http-tls"), "router")


async def _serve_https(certs):
    server = RouterServer(
        FakeBackend(tokenizer=FakeTokenizer()),
        host="127.0.0.1",
        port=0,
        http=HttpSettings(
            host="127.0.0.1", port=0, model_name=MODEL, tls_cert=certs.cert, tls_key=certs.key
        ),
    )
    await server.start()
    return server


def test_an_https_client_is_served_and_plain_http_is_refused(certs):
    async def body():
        server = await _serve_https(certs)
        try:
            url = server.http.url
            assert url.startswith("https://")
            trust = ssl.create_default_context(cafile=str(certs.ca))
            async with httpx.AsyncClient(verify=trust, timeout=10) as client:
                models = await client.get(f"{url}/v1/models")
            assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
            plain = url.replace("https://", "http://")
            async with httpx.AsyncClient(timeout=10) as client:
                with pytest.raises(httpx.TransportError):
                    await client.get(f"{plain}/v1/models")
            untrusting = ssl.create_default_context()  # the system CAs only
            async with httpx.AsyncClient(verify=untrusting, timeout=10) as client:
                with pytest.raises(httpx.ConnectError):
                    await client.get(f"{url}/v1/models")
        finally:
            await server.stop(0)

    asyncio.run(body())


def test_the_http_front_takes_the_grpc_certificate_unless_it_has_its_own(certs, tmp_path):
    both = ServeConfig(
        server={"http_port": 8000}, security={"tls_cert": certs.cert, "tls_key": certs.key}
    )
    settings = http_settings(both)
    assert (settings.tls_cert, settings.tls_key) == (certs.cert, certs.key)
    other = make_certs(tmp_path, "http")
    own = both.updated(security={"http_tls_cert": other.cert, "http_tls_key": other.key})
    assert http_settings(own).tls_cert == other.cert
    assert http_settings(ServeConfig(server={"http_port": 8000})).tls_cert is None
    with pytest.raises(ValueError, match="http_tls_cert and http_tls_key go together"):
        ServeConfig(security={"http_tls_cert": other.cert})
