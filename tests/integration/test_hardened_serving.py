"""A whole deployment with every lock on (router TLS, cluster TLS with a CA,
cluster secret), then fuzzed.

- Requests through the TLS router work, and the workers' internal endpoints
  listen on the node address Ray gave them (127.0.0.2), not every interface.
- A KV client without the secret, or without TLS, is refused by a worker.
- Property-based fuzzing of ``Generate``: random field values, huge prompts,
  extreme sampling values, thousands of stop strings, out-of-vocabulary ids.
  Every call ends with a precise status (INVALID_ARGUMENT naming a field,
  RESOURCE_EXHAUSTED for a message bigger than max_model_len can use, or
  gRPC's own for one past the port's bound) or a valid completion, within a
  deadline, and every worker's free block count returns to its start after
  each example.

Examples: ``TANDEM_FUZZ_EXAMPLES`` (default 60; raise it for a long run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kv_transfer import GrpcKVClient, TransferError
from net.security import ClusterSecurity
from protos.tandem.v1 import generate_pb2 as pb
from router.client import TandemClient
from router.config import ServeConfig
from router.limits import MESSAGE_HEADROOM_BYTES
from tandem_cli.serve import transport_message_limit
from tests.deployment_helpers import deployed
from tests.kv_harness import make_store
from tests.tls_certs import make_certs, openssl_available

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

SECRET = "hardened-cluster-secret"
MAX_MODEL_LEN = 96  # bounds every completion: a fuzzed max_tokens cannot run long
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "60"))
CALL_TIMEOUT_S = 60.0  # a call that outlives this is a hang: the test fails
INT32 = st.integers(-(2**31), 2**31 - 1)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if not openssl_available():
        pytest.skip("the openssl command is not installed")
    return make_certs(tmp_path_factory.mktemp("hardened"), "cluster")


ENGINE = {"kv_cache_memory_mb": 16, "max_model_len": MAX_MODEL_LEN}
TRANSPORT_LIMIT = transport_message_limit(ServeConfig(engine=ENGINE))
"""The gRPC port's own bound: bigger messages get gRPC's status, before our interceptor."""


@pytest.fixture(scope="module")
def hardened(ray_cluster, certs):
    config = ServeConfig(
        engine=ENGINE,
        transfer={"lease_s": 120},  # blocks must come back through the abort paths, not the lease
        security={
            "tls_cert": certs.cert,
            "tls_key": certs.key,
            "cluster_tls_cert": certs.cert,
            "cluster_tls_key": certs.key,
            "cluster_tls_ca": certs.ca,
            "cluster_secret": SECRET,
        },
    )
    with deployed(config) as deployment:
        yield deployment


async def _call(
    address: str, ca: bytes, request: pb.GenerateRequest
) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    async with TandemClient(address, root_certificates=ca) as client:
        assert client._stub is not None
        call = client._stub.Generate(request, timeout=CALL_TIMEOUT_S)
        responses: list[pb.GenerateResponse] = []
        try:
            async for r in call:
                responses.append(r)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", responses
        return grpc.StatusCode.OK, "", responses


def test_tls_router_and_secured_workers_serve(hardened, certs):
    ca = certs.ca.read_bytes()
    request = pb.GenerateRequest(prompt="def main():", max_tokens=12, temperature=0)
    code, _, responses = asyncio.run(_call(hardened.address, ca, request))
    assert code == grpc.StatusCode.OK
    final = responses[-1].final
    assert final.usage.completion_tokens == 12
    assert final.timings.prefill_worker.startswith("prefill")
    assert final.timings.decode_worker.startswith("decode")
    workers = hardened.backend.prefill.workers + hardened.backend.decode.workers
    for worker in workers:  # internal endpoints bind the node address Ray gave them
        assert worker.info.kv_address.startswith("127.0.0.2:"), worker.info
    assert hardened.backend.decode.workers[0].info.outputs.startswith("127.0.0.2:")
    assert hardened.wait_no_leaks() == {}


@pytest.mark.parametrize("who", ["no secret", "no tls"])
def test_a_worker_refuses_a_kv_peer_without_credentials(hardened, certs, who):
    good = hardened.config.transfer_config()
    if who == "no secret":
        stranger = ClusterSecurity.generate(good.security.tls)
        config = dataclasses.replace(good, security=stranger)
        expected = grpc.StatusCode.UNAUTHENTICATED
    else:
        config = dataclasses.replace(good, security=ClusterSecurity(SECRET.encode()))
        expected = grpc.StatusCode.UNAVAILABLE
    address = hardened.backend.prefill.workers[0].info.kv_address

    async def pull() -> grpc.StatusCode:
        client = GrpcKVClient(config)
        try:
            # Any sink: the layout is checked only once the peer is let in.
            await client.pull(address, make_store(4), [bytes(32)], timeout_s=10)
        except TransferError as e:
            return e.code
        finally:
            await client.close()
        return grpc.StatusCode.OK

    assert asyncio.run(pull()) == expected
    assert hardened.wait_no_leaks() == {}


def test_a_decode_worker_refuses_an_output_stream_without_the_secret(hardened):
    """The token streams are internal too: no secret, no tokens."""
    from router.pool_manager import WorkerHandle
    from router.worker_streams import WorkerStreams

    transfer = hardened.config.transfer_config()
    stranger = ClusterSecurity.generate(transfer.security.tls)
    no_secret = dataclasses.replace(transfer, security=stranger)
    decode = hardened.backend.decode.workers[0]
    intruder = WorkerHandle(decode.name, "decode", None, decode.info)

    async def subscribe() -> None:
        streams = WorkerStreams("intruder", lambda events: None, lambda w, why: None, no_secret)
        await streams.subscribe(intruder)

    with pytest.raises(ConnectionError):
        asyncio.run(subscribe())


# ---- fuzzing Generate ----

_floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
_extreme_floats = st.one_of(
    _floats, st.sampled_from([-0.0, 1e-45, 1e-7, 1e38, math.inf, -math.inf, math.nan, -1.0])
)


def _mostly(valid: st.SearchStrategy, extreme: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values about five times out of six, so that many requests reach
    the engine (``one_of`` alone leans towards the simplest branch)."""
    return st.sampled_from([False] * 5 + [True]).flatmap(lambda bad: extreme if bad else valid)


def _f32(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi, width=32)


_prompt_text = _mostly(
    st.text(min_size=1, max_size=80),
    st.one_of(st.just(""), st.integers(1, 200_000).map(lambda n: "ab " * n)),  # to 600k chars
)
_prompt_ids = _mostly(
    st.lists(st.integers(0, 1000), min_size=1, max_size=40),
    st.one_of(
        st.lists(INT32, max_size=40),  # out of vocabulary, negative
        st.integers(MAX_MODEL_LEN - 2, 50_000).map(lambda n: [7] * n),  # at and over the limit
    ),
)
_stop = _mostly(
    st.lists(st.text(min_size=1, max_size=6), max_size=8),
    st.one_of(
        st.integers(1000, 5000).map(lambda n: [f"s{i}" for i in range(n)]),  # thousands
        st.lists(st.text(max_size=300), max_size=3),  # empty and over-long ones
    ),
)
_stop_ids = _mostly(
    st.lists(st.integers(0, 1000), max_size=8),
    st.one_of(st.lists(INT32, max_size=8), st.integers(1000, 5000).map(lambda n: list(range(n)))),
)
_optional = {
    "max_tokens": _mostly(st.integers(1, 40), st.sampled_from([0, 10_000, 2**32 - 1])),
    "temperature": _mostly(_f32(0, 2), _extreme_floats),
    "top_p": _mostly(_f32(0.0625, 1), _extreme_floats),
    "top_k": _mostly(st.integers(-1, 100), INT32),
    "min_p": _mostly(_f32(0, 1), _extreme_floats),
    "repetition_penalty": _mostly(_f32(0.125, 2), _extreme_floats),
    "frequency_penalty": _mostly(_f32(-2, 2), _extreme_floats),
    "presence_penalty": _mostly(_f32(-2, 2), _extreme_floats),
    "seed": st.integers(0, 2**64 - 1),
    "logprobs": _mostly(st.integers(0, 20), st.sampled_from([21, 2**32 - 1])),
}


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["text"] * 5 + ["ids"] * 5 + ["both", "neither"]))
    if kind in ("text", "both"):
        req.prompt = draw(_prompt_text)
    if kind in ("ids", "both"):
        req.prompt_token_ids.extend(draw(_prompt_ids))
    if draw(st.booleans()):
        req.request_id = draw(_mostly(st.text(max_size=40), st.text(min_size=250, max_size=300)))
    for name, strategy in _optional.items():
        if draw(st.integers(0, 3)) == 0:  # each field set one time in four
            setattr(req, name, draw(strategy))
    if draw(st.integers(0, 3)) == 0:
        req.stop.extend(draw(_stop))
    if draw(st.integers(0, 3)) == 0:
        req.stop_token_ids.extend(draw(_stop_ids))
    req.ignore_eos = draw(st.booleans())
    return req


def _check_completion(req: pb.GenerateRequest, responses: list[pb.GenerateResponse]) -> None:
    assert responses and responses[-1].HasField("final"), "OK without a final message"
    assert all(r.HasField("chunk") for r in responses[:-1])
    final = responses[-1].final
    token_ids = [t for r in responses[:-1] for t in r.chunk.token_ids]
    assert final.usage.completion_tokens == len(token_ids)
    assert final.finish_reason in ("stop", "length")
    assert all(0 <= t < 2**31 for t in token_ids)
    limit = req.max_tokens if req.HasField("max_tokens") else 16
    assert 1 <= len(token_ids) <= limit
    assert final.usage.prompt_tokens + len(token_ids) <= MAX_MODEL_LEN
    if req.HasField("logprobs"):
        assert sum(len(r.chunk.logprobs) for r in responses[:-1]) == len(token_ids)


@pytest.mark.timeout(max(600, 10 * EXAMPLES))  # scales with TANDEM_FUZZ_EXAMPLES
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=False,
)
@given(req=generate_requests())
def test_fuzzed_generate_gets_a_precise_status_or_a_completion(hardened, certs, req):
    ca = certs.ca.read_bytes()
    code, details, responses = asyncio.run(_call(hardened.address, ca, req))
    event(code.name)
    if code == grpc.StatusCode.OK:
        _check_completion(req, responses)
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED and req.ByteSize() > TRANSPORT_LIMIT:
        assert "larger than max" in details, details  # the transport's bound, set when it binds
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # more than max_model_len can use
        assert req.ByteSize() > MESSAGE_HEADROOM_BYTES and "max_model_len" in details, details
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details, "INVALID_ARGUMENT without a message"
    assert hardened.wait_no_leaks() == {}


def test_an_oversized_message_gets_resource_exhausted_naming_its_bound(hardened, certs):
    """Between the model's bound and the port's: our interceptor's message, which
    names max_model_len; past the port's: gRPC's own (the fuzzer reaches both
    bands seldom)."""
    limit = hardened.server.generate_message_limit()
    assert MESSAGE_HEADROOM_BYTES < limit < TRANSPORT_LIMIT
    ca = certs.ca.read_bytes()
    for size, named in (((limit + TRANSPORT_LIMIT) // 2, "max_model_len"),
                        (TRANSPORT_LIMIT + 1, "larger than max")):  # fmt: skip
        request = pb.GenerateRequest(prompt="a" * size)
        code, details, _ = asyncio.run(_call(hardened.address, ca, request))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and named in details, (size, details)
    assert hardened.wait_no_leaks() == {}
