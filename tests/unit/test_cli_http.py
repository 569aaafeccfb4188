"""`tandem serve` with the HTTP front and API keys (over a FakeBackend), and
`tandem generate` sending $TANDEM_API_KEY."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from router.auth import ApiKeys
from router.config import ServeConfig
from tandem_cli import serve
from tandem_cli.main import build_parser, main
from tests.fakes import FakeBackend, FakeTokenizer, RouterInThread

pytestmark = pytest.mark.unit


def test_http_flags_and_keys_only_from_config_or_env(tmp_path, monkeypatch):
    argv = ["serve", "--http-port", "8001", "--http-host", "127.0.0.3", "--log-format", "json"]
    argv += ["--chat-template", "t.jinja", "--served-model-name", "m"]
    config = serve.config_from_args(build_parser().parse_args(argv))
    server = config.server
    assert (server.http_port, server.http_host, server.log_format) == (8001, "127.0.0.3", "json")
    assert (server.chat_template, server.served_model_name) == ("t.jinja", "m")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-keys", "k"])

    keys_file = tmp_path / "keys"
    keys_file.write_text("from-file\n")
    keys_file.chmod(0o600)
    monkeypatch.setenv("TANDEM_API_KEYS", "from-env")
    config = ServeConfig(security={"api_keys": ["from-yaml"], "api_keys_file": str(keys_file)})
    assert "from-yaml" not in repr(config) and "from-yaml" not in str(config.model_dump())
    keys = serve.api_keys(config)
    assert len(keys) == 3 and all(keys.check(k) for k in ("from-yaml", "from-file", "from-env"))


def test_http_front_is_off_unless_a_port_is_set():
    assert serve.http_settings(ServeConfig()) is None
    settings = serve.http_settings(ServeConfig(server={"http_port": 0, "host": "127.0.0.5"}))
    assert (settings.host, settings.port, settings.model_name) == (
        "127.0.0.5",
        0,
        "tandem-tiny-llama",
    )
    named = ServeConfig(server={"http_port": 9}, engine={"model": "/m/x"})
    assert serve.http_settings(named).model_name == "/m/x"


def test_serve_prints_the_http_url_and_guards_it_with_keys(capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", "k1,k2")

    async def body():
        backend = FakeBackend(tokenizer=FakeTokenizer())
        config = ServeConfig(server={"port": 0, "http_port": 0}, limits={"grace_period_s": 5})
        stop = asyncio.Event()
        serving = asyncio.create_task(serve.serve(config, backend=backend, stop=stop))
        try:
            await backend.wait_for(lambda b: b.started)
            await asyncio.sleep(0)
            line = capsys.readouterr().out
            assert "2 API keys" in line
            url = re.search(r"HTTP on (\S+) ", line).group(1)
            async with httpx.AsyncClient(base_url=url) as http:
                payload = {"model": "tandem-tiny-llama", "prompt": "hi", "max_tokens": 2}
                assert (await http.post("/v1/completions", json=payload)).status_code == 401
                ok = await http.post(
                    "/v1/completions", json=payload, headers={"authorization": "Bearer k2"}
                )
                assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " alpha beta"
        finally:
            stop.set()
            await serving

    asyncio.run(body())


def test_generate_sends_the_env_key(capsys, monkeypatch):
    backend = FakeBackend(tokenizer=FakeTokenizer())
    with RouterInThread(backend, api_keys=ApiKeys(["secret"])) as router:
        monkeypatch.delenv("TANDEM_API_KEY", raising=False)
        assert main(["generate", "hi", "--target", router.address, "--max-tokens", "1"]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("TANDEM_API_KEY", "secret")
        assert main(["generate", "hi", "--target", router.address, "--max-tokens", "1"]) == 0
        assert capsys.readouterr().out == " alpha\n"
