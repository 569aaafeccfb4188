"""The HTTP front fuzzed as the gRPC front is (tests/integration/test_hardened_serving.py):
random JSON, wrong types, huge numbers, NaN, odd and broken Unicode, bytes that are
not JSON, sent to /v1/completions and /v1/chat/completions over a FakeBackend. Every
answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx, and the router keeps
serving. Examples: ``TANDEM_FUZZ_EXAMPLES`` (default 60; raise it for a long run).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from router.backend import GenerateInput, GenerateResult, TokenDelta
from router.service import HttpSettings
from tests.fakes import FakeBackend, FakeTokenizer, RouterInThread
from tests.http_helpers import MODEL

pytestmark = pytest.mark.unit

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "60"))
CALL_TIMEOUT_S = 30.0  # a call that outlives this is a hang: the test fails
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
EDGE_INTS = [-1, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64, 2**70, -(2**70)]
ODD_TEXT = ["\ud800", "a\udfffb", "\x00", "\u202e", "\ufeff", "é" * 300, "\n\r\t", "🦙" * 50]


class BoundedBackend(FakeBackend):
    """FakeBackend that stops at max_model_len as an engine does, so that a fuzzed
    max_tokens that is valid but large finishes at once."""

    def generate(self, inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
        room = max(1, self.max_model_len - len(inp.prompt_token_ids))
        params = dataclasses.replace(inp.params, max_tokens=min(inp.params.max_tokens, room))
        return super().generate(dataclasses.replace(inp, params=params))


@pytest.fixture(scope="module")
def router():
    backend = BoundedBackend(tokenizer=FakeTokenizer(), delay_s=0)
    http = HttpSettings(host="127.0.0.1", port=0, model_name=MODEL)
    with RouterInThread(backend, http=http) as running:
        yield running


numbers = st.one_of(
    st.integers(), st.sampled_from(EDGE_INTS), st.floats(allow_nan=True, allow_infinity=True)
)
texts = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "bot"]), "content": texts}
        ),
        st.fixed_dictionaries({"role": st.just("user"), "content": json_values}),
        json_values,
    ),
    max_size=4,
)
FIELDS = {
    "prompt": st.one_of(texts, st.lists(st.one_of(numbers, texts), max_size=6), json_values),
    "messages": messages,
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "min_p": numbers,
    "seed": numbers,
    "n": numbers,
    "logprobs": st.one_of(numbers, st.booleans()),
    "top_logprobs": numbers,
    "stop": st.one_of(texts, st.lists(texts, max_size=20), json_values),
    "stop_token_ids": st.one_of(st.lists(numbers, max_size=6), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": json_values,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "logit_bias": json_values,
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "return_token_ids": st.one_of(st.booleans(), json_values),
    "echo": json_values,
    "response_format": json_values,
    "tools": json_values,
}
structured = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), json_values)}, optional=FIELDS
)
VALID = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}


@st.composite
def one_field_off(draw) -> dict:
    """A valid body (for either endpoint) with one field fuzzed."""
    name = draw(st.sampled_from(sorted(FIELDS)))
    return VALID | {name: draw(FIELDS[name])}


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["one field off", "structured", "any json", "bytes"]))
    event(kind)
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    strategy = {"one field off": one_field_off(), "structured": structured}.get(kind, json_values)
    doc = draw(strategy)
    return json.dumps(doc).encode()  # ASCII: lone surrogates become escapes; NaN is written


def _check(reply: httpx.Response) -> None:
    assert reply.status_code < 500, (reply.status_code, reply.text[:500])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    assert reply.status_code == 200
    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert all("error" not in json.loads(e) for e in events[:-1]), events
    else:
        assert reply.json()["choices"]


@pytest.mark.timeout(max(600, 10 * EXAMPLES))  # scales with TANDEM_FUZZ_EXAMPLES
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies())
def test_fuzzed_http_bodies_get_a_2xx_or_a_4xx_json_error(router, endpoint, body):
    with httpx.Client(base_url=router.http_url, timeout=CALL_TIMEOUT_S) as http:
        reply = http.post(endpoint, content=body, headers={"content-type": "application/json"})
    event(str(reply.status_code))
    _check(reply)


def test_the_router_serves_after_the_fuzzing(router):
    with httpx.Client(base_url=router.http_url, timeout=CALL_TIMEOUT_S) as http:
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        health = http.get("/health")
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    assert health.status_code == 200
    assert router.backend.running == set()
