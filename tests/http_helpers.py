"""Shared by the HTTP front's unit tests: a RouterServer with its HTTP front
over a FakeBackend, the openai SDK pointed at it, parsed /metrics."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import openai
from prometheus_client.parser import text_string_to_metric_families

from router.auth import ApiKeys
from router.service import HttpSettings, RouterServer
from tests.fakes import FakeBackend

MODEL = "fake-model"
KEY = "sk-test-key"


@contextlib.asynccontextmanager
async def serving(
    backend: FakeBackend, keys: tuple[str, ...] = (), **server_kwargs
) -> AsyncIterator[RouterServer]:
    server = RouterServer(
        backend,
        host="127.0.0.1",
        port=0,
        api_keys=ApiKeys(keys),
        http=HttpSettings(host="127.0.0.1", port=0, model_name=MODEL),
        **server_kwargs,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


def sdk(server: RouterServer, key: str = "unused") -> openai.AsyncOpenAI:
    assert server.http is not None
    return openai.AsyncOpenAI(base_url=f"{server.http.url}/v1", api_key=key, max_retries=0)


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
