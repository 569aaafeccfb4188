"""A client that survives the loss of its router: real RouterServers on
127.0.0.1 over FakeBackends, the first one stopped mid-stream; and the
router's checks of a client's ``resume_token_ids``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import openai
import pytest

from protos.tandem.v1 import generate_pb2 as pb
from router.client import TandemClient, collect
from router.client_failover import RoutersFailed
from router.service import RouterServer
from tests.fakes import FakeBackend, FakeTokenizer

pytestmark = pytest.mark.unit

WAIT_S = 10.0  # generous upper bound on waits for events; never a timing assertion
MAX_TOKENS = 8
UNREACHABLE = "127.0.0.1:1"


@contextlib.asynccontextmanager
async def routers(*backends: FakeBackend) -> AsyncIterator[list[RouterServer]]:
    servers = [RouterServer(b, host="127.0.0.1", port=0) for b in backends]
    for server in servers:
        await server.start()
    try:
        yield servers
    finally:
        for server in servers:
            await server.stop(0)


async def uninterrupted(**sampling) -> tuple[list[pb.GenerateResponse], FakeBackend]:
    backend = FakeBackend()
    async with routers(backend) as [server], TandemClient(server.address) as client:
        return [r async for r in client.generate([1, 2, 3], **sampling)], backend


def test_a_stream_cut_mid_request_goes_on_at_the_next_router():
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 7, "logprobs": 1}

    async def body():
        reference, _ = await uninterrupted(request_id="r", **sampling)
        first, second = FakeBackend(pause_after=3), FakeBackend()
        async with routers(first, second) as servers:
            targets = [s.address for s in servers]
            async with TandemClient(targets, timeout_s=WAIT_S) as client:
                stream = client.generate([1, 2, 3], request_id="r", **sampling)
                got = [await anext(stream) for _ in range(3)]
                await servers[0].stop(0)  # the router is lost mid-stream
                got += [r async for r in stream]
        assert [r.WhichOneof("response") for r in got] == [
            r.WhichOneof("response") for r in reference
        ]
        done, expected = collect(got), collect(reference)
        assert done.token_ids == expected.token_ids == list(range(MAX_TOKENS))
        assert done.text == expected.text
        assert [lp.token_id for lp in done.logprobs] == done.token_ids
        assert done.usage.completion_tokens == MAX_TOKENS  # the resumed ones counted
        assert done.request_id == "r" and done.finish_reason == "length"
        assert first.aborted == ["r"] and second.finished == ["r"]
        [inp] = second.inputs
        assert inp.request_id == "r" and inp.resume_token_ids == [0, 1, 2]
        assert inp.prompt_token_ids == [1, 2, 3]
        assert (inp.params.seed, inp.params.temperature) == (7, pytest.approx(0.8))

    asyncio.run(body())


def test_a_request_that_fails_before_its_first_token_is_tried_on_the_next_router():
    async def body():
        backend = FakeBackend()
        async with routers(backend) as [server]:
            targets = [UNREACHABLE, server.address]
            client = TandemClient(targets, timeout_s=WAIT_S)
            async with client:
                done = await client.complete([1, 2], max_tokens=3)
        assert done.token_ids == [0, 1, 2] and done.finish_reason == "length"
        [inp] = backend.inputs
        assert inp.resume_token_ids == []

    asyncio.run(body())


def test_a_refused_request_is_not_tried_elsewhere():
    async def body():
        first, second = FakeBackend(), FakeBackend()
        async with routers(first, second) as servers:
            client = TandemClient([s.address for s in servers])
            async with client:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await client.complete([1, 2], temperature=1000)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not isinstance(info.value, RoutersFailed)
        assert first.inputs == second.inputs == []

    asyncio.run(body())


def test_when_every_router_fails_the_error_lists_each_answer():
    async def body():
        targets = [UNREACHABLE, "127.0.0.1:2"]
        async with TandemClient(targets, timeout_s=WAIT_S, max_attempts=3) as client:
            with pytest.raises(RoutersFailed) as info:
                await client.complete([1, 2], max_tokens=3)
        error = info.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert [t for t, _, _ in error.answers] == [UNREACHABLE, "127.0.0.1:2", UNREACHABLE]
        assert "failed on 3 tries" in error.details()
        assert all(t in error.details() for t in targets)

    asyncio.run(body())


def test_one_router_is_tried_once_and_its_own_error_surfaces():
    async def body():
        async with TandemClient(UNREACHABLE, timeout_s=WAIT_S) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.complete([1, 2], max_tokens=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not isinstance(info.value, RoutersFailed)

    asyncio.run(body())


# ---- the router's side: resume_token_ids -------------------------------------


def _resume_backend() -> FakeBackend:
    return FakeBackend(tokenizer=FakeTokenizer(), max_model_len=16, eos_token_ids=(9,))


async def _call(backend: FakeBackend, prompt, **sampling) -> list[pb.GenerateResponse]:
    async with routers(backend) as [server], TandemClient(server.address) as client:
        return [r async for r in client.generate(prompt, **sampling)]


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"resume_token_ids": [1, 256]}, "resume_token_ids[1] = 256 is outside the vocabulary"),
        ({"resume_token_ids": [1, 2, 3], "max_tokens": 2}, "more than max_tokens (2)"),
        ({"resume_token_ids": list(range(1, 15)), "max_tokens": 20}, "exceed max_model_len"),
        ({"resume_token_ids": [1, 7, 2], "stop_token_ids": [7]}, "resume_token_ids[1] already"),
        ({"resume_token_ids": [1, 9, 2]}, "resume_token_ids[1] already ends the request (stop)"),
        ({"resume_token_ids": [1, 2], "max_tokens": 1}, "more than max_tokens (1)"),
    ],
)
def test_resumed_tokens_are_checked(sampling, field):
    async def body():
        backend = _resume_backend()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _call(backend, [1, 2, 3], **sampling)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
        assert backend.inputs == []

    asyncio.run(body())


@pytest.mark.parametrize(
    ("sampling", "reason"),
    [
        ({"resume_token_ids": [1, 7], "stop_token_ids": [7]}, "stop"),
        ({"resume_token_ids": [1, 9]}, "stop"),  # the model's EOS
        ({"resume_token_ids": [1, 2, 3], "max_tokens": 3}, "length"),
        ({"resume_token_ids": [1] * 13, "max_tokens": 20}, "length"),  # max_model_len 16
        ({"resume_token_ids": list(b"x>>"), "stop": [">>"]}, "stop"),
    ],
)
def test_resumed_tokens_that_end_the_request_end_it_at_once(sampling, reason):
    async def body():
        backend = _resume_backend()
        responses = await _call(backend, [1, 2, 3], **sampling)
        [final] = [r.final for r in responses]  # no chunk
        assert final.finish_reason == reason
        assert final.usage.completion_tokens == len(sampling["resume_token_ids"])
        assert final.usage.prompt_tokens == 3
        assert backend.inputs == []

    asyncio.run(body())


@pytest.mark.parametrize(
    "sampling",
    [
        {"resume_token_ids": [1, 9], "ignore_eos": True},
        {"resume_token_ids": [1, 2]},
        {"resume_token_ids": list(b"x>"), "stop": [">>"]},  # a stop string's prefix only
    ],
)
def test_resumed_tokens_that_do_not_end_it_go_on(sampling):
    async def body():
        backend = _resume_backend()
        responses = await _call(backend, [1, 2, 3], max_tokens=4, **sampling)
        done = collect(responses)
        resumed = sampling["resume_token_ids"]
        assert done.token_ids == list(range(len(resumed), 4))
        assert done.usage.completion_tokens == 4
        [inp] = backend.inputs
        assert inp.resume_token_ids == resumed and inp.resumed_finish is None

    asyncio.run(body())


# ---- the HTTP front's extension ----------------------------------------------


def test_http_completions_resume_after_the_tokens_given():
    from tests.http_helpers import MODEL, sdk, serving

    async def body():
        backend = _resume_backend()
        async with serving(backend) as server:
            client = sdk(server)
            done = await client.completions.create(
                model=MODEL,
                prompt=[1, 2, 3],
                max_tokens=4,
                extra_body={"resume_token_ids": [0, 1], "return_token_ids": True},
            )
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(
                    model=MODEL,
                    prompt=[1, 2],
                    max_tokens=1,
                    extra_body={"resume_token_ids": [1, 2]},
                )
        assert done.choices[0].text == " gamma delta"  # tokens 2 and 3
        assert done.usage.completion_tokens == 4
        assert backend.inputs[0].resume_token_ids == [0, 1]
        assert "resume_token_ids has 2 tokens, more than max_tokens (1)" in str(info.value)

    asyncio.run(body())


def test_tandem_generate_takes_several_targets(capsys):
    from tandem_cli.main import main
    from tests.fakes import RouterInThread

    backend = FakeBackend(tokenizer=FakeTokenizer())
    with RouterInThread(backend) as router:
        argv = ["generate", "hi", "--target", f"{UNREACHABLE},{router.address}"]
        code = main([*argv, "--max-tokens", "3", "--timeout", "30"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == " alpha beta gamma\n"
    assert main(["generate", "hi", "--target", " , "]) == 2


@pytest.mark.parametrize(
    ("code", "resumed", "lost"),
    [
        (grpc.StatusCode.UNAVAILABLE, False, True),  # a dead router, a drain's cut
        (grpc.StatusCode.CANCELLED, False, True),  # cancelled by the other side
        (grpc.StatusCode.ALREADY_EXISTS, True, True),  # the broken call still ending there
        (grpc.StatusCode.ALREADY_EXISTS, False, False),  # the caller's id is taken
        (grpc.StatusCode.INVALID_ARGUMENT, True, False),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False, False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, True, False),
        (grpc.StatusCode.INTERNAL, False, False),
    ],
)
def test_which_failures_move_a_request_to_the_next_router(code, resumed, lost):
    from router.client_failover import router_lost

    assert router_lost(grpc.aio.AioRpcError(code, details="x"), resumed) is lost


def test_leaving_the_loop_early_is_not_a_lost_router():
    async def body():
        first, second = FakeBackend(pause_after=2), FakeBackend()
        async with routers(first, second) as servers:
            client = TandemClient([s.address for s in servers])
            async with client:
                async for _ in client.generate([1, 2], max_tokens=MAX_TOKENS):
                    break
                await first.wait_for(lambda b: b.aborted, WAIT_S)
        assert second.inputs == []

    asyncio.run(body())
