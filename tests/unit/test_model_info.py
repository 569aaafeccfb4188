"""What model is served and its limits: GetModelInfo on the gRPC API,
/v1/models on the HTTP front, and `tandem bench` sizing its workload by them,
against a real RouterServer over a FakeBackend of 8,000 tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import httpx
import pytest

from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc
from router.auth import ApiKeys
from router.client import TandemClient
from router.lifecycle import STARTING
from router.model_info import ModelInfo
from router.service import HttpSettings, RouterServer
from tandem_cli import serve
from tandem_cli.main import main
from tests.fakes import FakeBackend, FakeTokenizer, RouterInThread
from tests.http_helpers import KEY, MODEL, serving

pytestmark = pytest.mark.unit

VOCAB, CONTEXT = 8000, 4096
WAIT_S = 10.0  # an upper bound on waits for events; never a timing assertion


def fake(**kwargs) -> FakeBackend:
    """The user's report: a model of 8,000 tokens (the old bench drew ids up to 30,000)."""
    return FakeBackend(vocab_size=VOCAB, max_model_len=CONTEXT, block_size=32, delay_s=0, **kwargs)


EXPECTED = ModelInfo(
    name=MODEL, vocab_size=VOCAB, max_model_len=CONTEXT, has_tokenizer=False, block_size=32
)


def test_get_model_info_gives_the_backend_figures_and_needs_the_key():
    async def body():
        async with serving(fake(), keys=(KEY,)) as server:
            async with TandemClient(server.address, api_key=KEY) as client:
                assert await client.model_info() == EXPECTED
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = generate_pb2_grpc.TandemStub(channel)
                for metadata in ((), (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(body())


def test_get_model_info_is_unavailable_while_starting():
    async def body():
        backend = fake(start_gate=asyncio.Event())
        server = RouterServer(backend, host="127.0.0.1", port=0)
        starting = asyncio.create_task(server.start())
        async with asyncio.timeout(WAIT_S):
            while server.port == 0:
                await asyncio.sleep(0.01)
        async with TandemClient(server.address) as client:
            async with asyncio.timeout(WAIT_S):
                await client._channel.channel_ready()  # listening, still starting
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.model_info()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == STARTING
            backend.start_gate.set()
            await starting
            assert await client.model_info() == EXPECTED
        await server.stop(0)

    asyncio.run(body())


def test_v1_models_carries_the_same_figures():
    async def body():
        async with serving(fake(tokenizer=FakeTokenizer()), keys=(KEY,)) as server:
            headers = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=server.http.url) as http:
                assert (await http.get("/v1/models")).status_code == 401
                reply = await http.get("/v1/models", headers=headers)
        (card,) = reply.json()["data"]
        assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "tandem"
        assert card["max_model_len"] == CONTEXT and card["vocab_size"] == VOCAB
        assert card["has_tokenizer"] is True and card["block_size"] == 32
        assert ModelInfo.from_card(card) == dataclasses.replace(EXPECTED, has_tokenizer=True)

    asyncio.run(body())


def bench(target: str, tmp_path, *extra: str) -> list[str]:
    return [
        "bench",
        "--target",
        target,
        "--no-progress",
        "--no-plots",
        "--out",
        str(tmp_path),
        "--concurrency",
        "4",
        *extra,
    ]


def report_of(tmp_path) -> dict:
    return json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_bench_draws_token_ids_within_the_served_vocabulary(front, tmp_path, capsys):
    backend = fake()
    http = HttpSettings(host="127.0.0.1", port=0, model_name=MODEL)
    with RouterInThread(backend, http=http) as router:
        target = router.address if front == "grpc" else router.http_url
        argv = bench(target, tmp_path, "--num-requests", "24", "--output-len", "2")
        rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    (run,) = report_of(tmp_path)["runs"]
    assert run["summary"]["errors"] == {} and run["summary"]["completed"] == 24
    assert "model fake-model: vocab_size 8000, max_model_len 4096" in out
    assert report_of(tmp_path)["model"]["vocab_size"] == VOCAB
    ids = [t for inp in backend.inputs for t in inp.prompt_token_ids]
    assert len(backend.inputs) == 24 and len(ids) >= 24 * 64  # default input 64:256
    assert min(ids) >= 10 and max(ids) < VOCAB
    assert max(ids) >= 0.9 * VOCAB  # the whole vocabulary, not a corner of it


def test_bench_summary_says_why_requests_failed(tmp_path, capsys):
    backend = fake(fail_every=3)
    with RouterInThread(backend) as router:
        rc = main(bench(router.address, tmp_path, "--num-requests", "12", "--output-len", "2"))
    out = capsys.readouterr().out
    assert rc == 0, out  # some requests succeeded
    s = report_of(tmp_path)["runs"][0]["summary"]
    assert s["errors"] == {"INTERNAL": 4} and s["completed"] == 8
    message = "generation failed: RuntimeError: scripted failure (fail_every=3)"
    assert s["first_errors"] == {"INTERNAL": message}
    assert "errors      INTERNAL: 4" in out
    assert f"  first INTERNAL: {message}" in out.splitlines()


def test_bench_refuses_a_workload_beyond_max_model_len(tmp_path, capsys):
    backend = fake()
    backend.max_model_len = 300  # default lengths need 256 + 64
    with RouterInThread(backend) as router:
        assert main(bench(router.address, tmp_path)) == 2
        err = capsys.readouterr().err
        assert "needs up to 320 tokens per request" in err and "max_model_len of 300" in err
        rc = main(bench(router.address, tmp_path, "--input-len", "200", "--num-requests", "2"))
        assert rc == 0
        dataset = tmp_path / "ids.jsonl"
        dataset.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt_token_ids": [9000]}\n')
        assert main(bench(router.address, tmp_path, "--dataset", str(dataset))) == 2
        assert "dataset row 2: token id 9000 is outside the served vocabulary" in (
            capsys.readouterr().err
        )
    assert len(backend.inputs) == 2  # refused workloads sent nothing


def test_bench_asks_with_the_api_key(tmp_path, capsys, monkeypatch):
    backend = fake()
    with RouterInThread(backend, api_keys=ApiKeys(["secret"])) as router:
        monkeypatch.delenv("TANDEM_API_KEY", raising=False)
        assert main(bench(router.address, tmp_path)) == 1
        err = capsys.readouterr().err
        assert "cannot get the served model" in err and "UNAUTHENTICATED" in err
        monkeypatch.setenv("TANDEM_API_KEY", "secret")
        assert main(bench(router.address, tmp_path, "--num-requests", "2")) == 0
    assert len(backend.inputs) == 2


def test_ray_backend_names_the_model_as_the_http_front_does():
    from router.config import ServeConfig
    from router.ray_backend import RayBackend

    assert RayBackend(ServeConfig()).model_name == "tandem-tiny-llama"
    backend = RayBackend(ServeConfig(engine={"model": "/m/x", "block_size": 32}))
    assert (backend.model_name, backend.block_size) == ("/m/x", 32)
    named = ServeConfig(engine={"model": "/m/x"}, server={"served_model_name": "m", "http_port": 0})
    assert RayBackend(named).model_name == "m" == serve.http_settings(named).model_name
