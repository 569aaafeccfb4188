"""The router's tries of one request (router/ray_backend.py: ``generate``,
``_attempt``, ``_next_delta``, ``_prefill``, ``_abort``), against fake worker
actors and a fake output-stream hub: no Ray cluster, no sockets.

A fake prefill actor plays both workers of a disaggregated try: its
``prefill.remote(req)`` hands the request to a script that puts the decode
worker's RequestDelta frames into the queue the router registered for the
try's id, and returns a PrefillResult. Scripts that must let the router read
some frames before the next ones wait on the client's progress (events), not
on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from block_index import InMemoryIndex, KVEvent
from engine.hashing import hash_blocks, root_hash
from engine.sampling import SamplingParams
from kv_transfer import TransferError
from net.grants import PUSH, GrantChecker, GrantRefused, push_digest
from protocol.requests import DecodeRequest, PrefillRequest, PrefillResult
from protocol.workers import WorkerHealth, WorkerInfo
from protos.tandem.v1 import worker_pb2
from router.backend import GenerateInput, GenerateResult, TokenDelta
from router.config import ServeConfig
from router.failover import RetryPolicy, WorkerLost
from router.pool_manager import WorkerHandle
from router.prefix_routing import PrefixRouter
from router.ray_backend import RayBackend
from router.worker_streams import DeltaQueue

pytestmark = pytest.mark.unit

PROMPT = list(range(100, 140))  # 2.5 blocks of 16
PARAMS = SamplingParams(temperature=0, max_tokens=8)
HANG_S = 20.0  # a broken router waits forever: fail instead (not a timing check)


class FakeStreams:
    """WorkerStreams' request side: a queue per registered try; the cache
    events a prefill reply names count as arrived at once."""

    def __init__(self) -> None:
        self.queues: dict[str, tuple[DeltaQueue, WorkerHandle]] = {}
        self.registered: list[str] = []
        self.events_awaited: list[tuple[str, int]] = []

    async def caught_up(self, worker: WorkerHandle, seq: int) -> None:
        self.events_awaited.append((worker.name, seq))

    def register(self, request_id: str, worker: WorkerHandle, unread=None, on_cut=None):
        queue = DeltaQueue(unread, on_cut)
        self.queues[request_id] = (queue, worker)
        self.registered.append(request_id)
        return queue

    def unregister(self, request_id: str) -> None:
        entry = self.queues.pop(request_id, None)
        if entry is not None:
            entry[0].close()

    async def subscribe(self, worker: WorkerHandle) -> None:
        pass

    async def unsubscribe(self, worker: WorkerHandle) -> None:
        pass

    async def close(self) -> None:
        pass


@dataclass
class Try:
    """One call a fake worker received: the request, the workers, and the
    decode worker's stream for it."""

    request: PrefillRequest | DecodeRequest
    prefill_worker: str | None
    decode_worker: str
    queue: DeltaQueue
    spawn: Callable[[Awaitable[Any]], None]  # the decode worker streams on after the call
    sent: int = 0  # output tokens the decode worker has streamed for this try

    def push(self, *tokens: int, finished: bool = False, reason: str = "") -> None:
        """One RequestDelta frame from the decode worker."""
        self.sent += len(tokens)
        self.queue.put(
            worker_pb2.RequestDelta(
                request_id=self.request.request_id,
                token_ids=list(tokens),
                finished=finished,
                finish_reason=reason,
                num_output_tokens=len(self.request.output_token_ids) + self.sent,
            )
        )

    def lose(self) -> None:
        self.queue.put_lost()

    def result(self, aborted: bool = False) -> PrefillResult:
        return PrefillResult(self.request.request_id, aborted, 4096, 0, 0.001, 0.002)


Script = Callable[[Try], Awaitable[Any]]


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)


class Cluster:
    """The fake workers' side: what they were asked, and per call (in order)
    the script that plays it."""

    def __init__(self, streams: FakeStreams, scripts: list[Script]) -> None:
        self.streams = streams
        self.scripts = list(scripts)
        self.tries: list[Try] = []
        self.prefill_calls: list[str] = []  # worker names
        self.start_calls: list[str] = []
        self.aborts: list[tuple[str, str]] = []  # (worker, request id), when sent
        self.by_kv: dict[str, str] = {}  # kv address -> worker name
        self.background: list[asyncio.Task] = []

    def handle(self, name: str, role: str) -> WorkerHandle:
        actor = type("FakeActor", (), {})()
        actor.prefill = _Method(lambda req: self._prefill(name, req))
        actor.start_full = _Method(lambda req: self._start_full(name, req))
        actor.abort = _Method(lambda rid: self._abort(name, rid))
        kv = f"{name}.kv:1"
        self.by_kv[kv] = name
        info = WorkerInfo(name, 4096, 1000, "fp", f"{name}-1", "/model", kv_address=kv)
        actor.health = _Method(lambda: _healthy(info))
        return WorkerHandle(name, role, actor, info)

    def spawn(self, coro: Awaitable[Any]) -> None:
        """The decode worker streaming on after the call returned."""
        self.background.append(asyncio.ensure_future(coro))

    async def _prefill(self, name: str, req: PrefillRequest) -> PrefillResult:
        self.prefill_calls.append(name)
        queue, _ = self.streams.queues[req.request_id]
        t = Try(req, name, self.by_kv[req.decode_kv_address], queue, self.spawn)
        self.tries.append(t)
        return await self.scripts.pop(0)(t)

    async def _start_full(self, name: str, req: DecodeRequest) -> None:
        self.start_calls.append(name)
        queue, _ = self.streams.queues[req.request_id]
        t = Try(req, None, name, queue, self.spawn)
        self.tries.append(t)
        await self.scripts.pop(0)(t)

    def _abort(self, name: str, rid: str) -> Awaitable[None]:
        self.aborts.append((name, rid))  # a Ray call is sent when .remote() returns

        async def done() -> None:
            pass

        return done()


async def _healthy(info: WorkerInfo) -> WorkerHealth:
    return WorkerHealth(info.name, info.incarnation, True, 10, 10, 0)


@dataclass
class Setup:
    backend: RayBackend
    cluster: Cluster
    streams: FakeStreams
    prefill: list[WorkerHandle] = field(default_factory=list)
    decode: list[WorkerHandle] = field(default_factory=list)

    def worker(self, name: str) -> WorkerHandle:
        return next(w for w in self.prefill + self.decode if w.name == name)


def make_backend(scripts: list[Script], colocated: bool = False) -> Setup:
    mode = "colocated" if colocated else "disaggregated"
    # No wait between tries; the watchdog never asks a fake for its health.
    config = ServeConfig(pools={"mode": mode}, tuning={"stall_check_s": 60})
    backend = RayBackend(config)
    backend.retry = RetryPolicy(config.tuning.max_attempts, backoff_s=0)
    streams = FakeStreams()
    cluster = Cluster(streams, scripts)
    setup = Setup(backend, cluster, streams)
    if not colocated:
        setup.prefill = [cluster.handle(f"p{i}", "prefill") for i in range(2)]
    role = "colocated" if colocated else "decode"
    setup.decode = [cluster.handle(f"d{i}", role) for i in range(2)]
    backend.prefill.workers = list(setup.prefill)
    backend.decode.workers = list(setup.decode)
    # Members as the deployment's membership would hand them over (member_sync.adopt).
    backend.members.known = {w.name: w for w in [*setup.prefill, *setup.decode]}
    backend.streams = streams
    backend.index = InMemoryIndex()
    backend.routing = PrefixRouter(
        backend.index,
        backend.block_size,
        root_hash("fake-model", backend.block_size),
        backend.policy,
    )
    return setup


def run(coro: Awaitable[Any]) -> Any:
    async def guarded() -> Any:
        async with asyncio.timeout(HANG_S):
            return await coro

    return asyncio.run(guarded())


async def collect(
    setup: Setup, on_tokens: Callable[[list[int]], Any] | None = None
) -> tuple[list[int], GenerateResult]:
    """The client: every token in order, then the result (which comes last).
    ``on_tokens`` sees the tokens so far after each delta (awaited if async)."""
    tokens: list[int] = []
    result = None
    async for item in setup.backend.generate(GenerateInput("req", PROMPT, PARAMS)):
        assert result is None, "nothing follows the result"
        if isinstance(item, TokenDelta):
            assert item.token_ids
            tokens += item.token_ids
            if on_tokens is not None and asyncio.iscoroutine(hook := on_tokens(tokens)):
                await hook
        else:
            result = item
    assert isinstance(result, GenerateResult)
    return tokens, result


async def settle(setup: Setup) -> None:
    """Let the fake decode workers and cancelled calls run to their end."""
    await asyncio.gather(*setup.cluster.background, return_exceptions=True)
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    await asyncio.gather(*others, return_exceptions=True)


def assert_clean(setup: Setup) -> None:
    """No try left anything behind in the router."""
    assert [w.in_flight for w in setup.prefill + setup.decode] == [0] * (
        len(setup.prefill) + len(setup.decode)
    )
    assert setup.streams.queues == {}
    assert setup.cluster.scripts == [], "every scripted call was made"


def rid_of(t: Try) -> str:
    return t.request.request_id


# ---- 1. a normal disaggregated try ------------------------------------------


def test_a_disaggregated_try_streams_every_token_then_the_result():
    async def serve(t: Try) -> PrefillResult:
        t.push(11)
        t.push(12)
        t.push(13, finished=True, reason="stop")
        return t.result()

    setup = make_backend([serve])

    async def main():
        tokens, result = await collect(setup)
        await settle(setup)
        return tokens, result

    tokens, result = run(main())
    (t,) = setup.cluster.tries
    assert tokens == [11, 12, 13]
    assert result.finish_reason == "stop"
    assert result.completion_tokens == 3
    assert result.prompt_tokens == len(PROMPT)
    assert (result.prefill_worker, result.decode_worker) == (t.prefill_worker, t.decode_worker)
    assert result.kv_transfer_bytes == 4096
    assert setup.cluster.prefill_calls == [t.prefill_worker]
    assert setup.cluster.start_calls == []
    assert setup.cluster.aborts == []
    req = t.request
    assert isinstance(req, PrefillRequest)
    assert req.request_id.startswith("req#") and req.request_id != "req"
    assert req.prompt_token_ids == PROMPT
    assert req.output_token_ids == []
    assert req.router_id == setup.backend.router_id
    assert req.decode_kv_address == setup.worker(t.decode_worker).info.kv_address
    assert setup.streams.registered == [req.request_id]
    assert setup.backend.failover.retries == 0
    assert_clean(setup)


def test_a_try_carries_the_cache_salt_and_a_push_grant_for_its_decode_worker():
    async def serve(t: Try) -> PrefillResult:
        t.push(11, finished=True, reason="stop")
        return t.result()

    setup = make_backend([serve])

    async def main():
        inp = GenerateInput("req", PROMPT, PARAMS, cache_salt=b"tenant-a")
        items = [item async for item in setup.backend.generate(inp)]
        await settle(setup)
        return items

    run(main())
    (t,) = setup.cluster.tries
    req = t.request
    assert isinstance(req, PrefillRequest) and req.cache_salt == b"tenant-a"
    security = setup.backend.config.transfer_config().security
    decode = GrantChecker(security, req.decode_kv_address)
    with pytest.raises(GrantRefused):  # bound to the salt
        decode.use(req.push_grant, PUSH, req.request_id, push_digest(b""))
    decode.use(req.push_grant, PUSH, req.request_id, push_digest(b"tenant-a"))
    other = GrantChecker(security, setup.worker("p0").info.kv_address)
    with pytest.raises(GrantRefused):  # bound to the decode worker
        other.use(req.push_grant, PUSH, req.request_id, push_digest(b"tenant-a"))
    assert req.pull_from is None and req.pull_grant == b""
    assert_clean(setup)


def test_tokens_streamed_while_the_prefill_call_runs_reach_the_client():
    """The decode worker streams while the prefill call has not returned:
    the router reads the stream and the call at once."""
    first_seen = asyncio.Event()

    async def serve(t: Try) -> PrefillResult:
        t.push(11)
        await first_seen.wait()  # the client got the first token: the call is still on
        t.push(12, finished=True, reason="length")
        return t.result()

    setup = make_backend([serve])

    async def main():
        tokens, result = await collect(setup, lambda toks: first_seen.set())
        await settle(setup)
        return tokens, result

    tokens, result = run(main())
    assert tokens == [11, 12]
    assert (result.finish_reason, result.completion_tokens) == ("length", 2)
    assert setup.cluster.aborts == []
    assert_clean(setup)


# ---- 2. the prefill call fails: the next try goes to the other pair ------------


@pytest.mark.parametrize(
    "error",
    [
        TransferError(grpc.StatusCode.UNAVAILABLE, "decode worker unreachable"),
        WorkerLost("p?", "actor died"),
    ],
    ids=["transfer", "worker_lost"],
)
def test_a_failed_prefill_call_is_aborted_and_tried_on_the_other_pair(error):
    async def fail(t: Try) -> PrefillResult:
        raise error

    async def serve(t: Try) -> PrefillResult:
        t.push(21)
        t.push(22, finished=True, reason="stop")
        return t.result()

    setup = make_backend([fail, serve])

    async def main():
        tokens, result = await collect(setup)
        await settle(setup)
        return tokens, result

    tokens, result = run(main())
    first, second = setup.cluster.tries
    assert tokens == [21, 22]
    assert result.completion_tokens == 2
    assert {first.prefill_worker, second.prefill_worker} == {"p0", "p1"}
    assert {first.decode_worker, second.decode_worker} == {"d0", "d1"}
    assert (result.prefill_worker, result.decode_worker) == (
        second.prefill_worker,
        second.decode_worker,
    )
    assert rid_of(first) != rid_of(second)
    assert setup.streams.registered == [rid_of(first), rid_of(second)]
    # The failed try is aborted on its decode worker (which the push may have
    # reached). Its prefill call has ended: the prefill worker dropped the
    # request itself (PrefillWorker.prefill aborts it on any failure).
    assert setup.cluster.aborts == [(first.decode_worker, rid_of(first))]
    assert second.request.output_token_ids == []
    assert setup.backend.failover.retries == 1
    assert setup.backend.failover.resumed == 0
    assert_clean(setup)


def test_a_prefill_worker_that_dropped_the_request_fails_the_try():
    """PrefillResult.aborted: nothing was pushed, the try fails over."""

    async def dropped(t: Try) -> PrefillResult:
        return t.result(aborted=True)

    async def serve(t: Try) -> PrefillResult:
        t.push(21, finished=True, reason="stop")
        return t.result()

    setup = make_backend([dropped, serve])
    tokens, _ = run(collect(setup))
    first, second = setup.cluster.tries
    assert tokens == [21]
    assert second.prefill_worker != first.prefill_worker
    assert setup.cluster.aborts == [(first.decode_worker, rid_of(first))]
    assert_clean(setup)


@pytest.mark.parametrize("when", ["router_waits", "client_holds_token"])
def test_a_prefill_call_that_fails_after_the_first_frame_does_not_fail_the_try(when):
    """The decode worker streamed the first token, then the prefill call
    failed (its reply lost, while the router waited for the next delta or
    while the client held the first token): the request is the decode
    worker's by then, so the try goes on and nothing is retried."""
    first_seen, prefill_failed = asyncio.Event(), asyncio.Event()

    async def decode_goes_on(t: Try) -> None:
        await prefill_failed.wait()
        t.push(12, finished=True, reason="stop")

    async def fail_late(t: Try) -> PrefillResult:
        t.push(11)
        t.spawn(decode_goes_on(t))
        await first_seen.wait()
        prefill_failed.set()
        raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "push reply lost")

    setup = make_backend([fail_late])

    async def on_tokens(tokens: list[int]) -> None:
        first_seen.set()
        if when == "client_holds_token" and tokens == [11]:
            await settle(setup)  # the prefill call has failed

    async def main():
        tokens, result = await collect(setup, on_tokens)
        await settle(setup)
        return tokens, result

    tokens, result = run(main())
    assert tokens == [11, 12] and result.completion_tokens == 2
    assert len(setup.cluster.tries) == 1 and setup.cluster.aborts == []
    assert setup.backend.failover.retries == 0
    assert result.kv_transfer_s is None  # the failed call reported no transfer
    assert_clean(setup)


# ---- 3. the decode stream breaks: the next try resumes after the tokens --------


@pytest.mark.parametrize("breaks", ["lost", "abort_delta"])
def test_a_broken_decode_stream_resumes_after_the_tokens_streamed(breaks):
    two_seen = asyncio.Event()

    async def stream_then_break(t: Try) -> None:
        await two_seen.wait()  # the router has read both tokens
        if breaks == "lost":
            t.lose()
        else:
            t.push(finished=True, reason="abort")

    async def serve_then_break(t: Try) -> PrefillResult:
        t.push(11)
        t.push(12)
        t.spawn(stream_then_break(t))
        return t.result()

    async def resume(t: Try) -> PrefillResult:
        t.push(13)
        t.push(14, finished=True, reason="length")
        return t.result()

    setup = make_backend([serve_then_break, resume])

    def on_tokens(tokens: list[int]) -> None:
        if len(tokens) >= 2:
            two_seen.set()

    async def main():
        tokens, result = await collect(setup, on_tokens)
        await settle(setup)
        return tokens, result

    tokens, result = run(main())
    first, second = setup.cluster.tries
    assert tokens == [11, 12, 13, 14]
    assert second.request.output_token_ids == [11, 12]
    assert second.request.prompt_token_ids == PROMPT
    assert (result.finish_reason, result.completion_tokens) == ("length", 4)
    assert second.decode_worker != first.decode_worker
    assert second.prefill_worker != first.prefill_worker
    assert (result.prefill_worker, result.decode_worker) == (
        second.prefill_worker,
        second.decode_worker,
    )
    # The prefill call had returned: the decode worker alone held the try.
    assert setup.cluster.aborts == [(first.decode_worker, rid_of(first))]
    assert setup.backend.failover.retries == 1
    assert setup.backend.failover.resumed == 1
    assert_clean(setup)


def test_tokens_queued_behind_an_abort_delta_are_tried_again_not_lost():
    """The router fell behind: two tokens and the decode worker's abort are
    queued together. Whatever the client got, the next try resumes exactly
    after it: no token repeated, none missing."""

    async def burst(t: Try) -> PrefillResult:
        t.push(11)
        t.push(12)
        t.push(finished=True, reason="abort")
        return t.result()

    async def resume(t: Try) -> PrefillResult:
        done = list(t.request.output_token_ids)
        rest = [11, 12, 13, 14][len(done) :]
        for tok in rest[:-1]:
            t.push(tok)
        t.push(rest[-1], finished=True, reason="length")
        return t.result()

    setup = make_backend([burst, resume])
    tokens, result = run(collect(setup))
    _, second = setup.cluster.tries
    assert tokens == [11, 12, 13, 14]
    assert result.completion_tokens == 4
    assert second.request.output_token_ids in ([], [11, 12])
    assert_clean(setup)


# ---- 4. no prefill worker in the plan: one start_full call --------------------


def _serve_full(t: Try) -> Awaitable[None]:
    async def stream() -> None:
        assert isinstance(t.request, DecodeRequest)
        t.push(31)
        t.push(32, finished=True, reason="stop")

    return stream()


def test_colocated_mode_calls_start_full_once_and_never_prefill():
    setup = make_backend([_serve_full], colocated=True)
    tokens, result = run(collect(setup))
    (t,) = setup.cluster.tries
    assert tokens == [31, 32]
    assert setup.cluster.start_calls == [t.decode_worker]
    assert setup.cluster.prefill_calls == []
    req = t.request
    assert isinstance(req, DecodeRequest)
    assert (req.prompt_token_ids, req.output_token_ids, req.params) == (PROMPT, [], PARAMS)
    assert req.router_id == setup.backend.router_id
    assert (result.prefill_worker, result.decode_worker) == (t.decode_worker, t.decode_worker)
    assert result.kv_transfer_s is None and result.kv_transfer_bytes == 0
    assert setup.cluster.aborts == []
    assert_clean(setup)


def test_a_decode_worker_holding_the_prefix_prefills_the_tail_itself():
    """Disaggregated, but d1 holds the prompt's full blocks and the tail is
    short (local_prefill_tokens): d1 alone gets the request."""
    setup = make_backend([_serve_full])
    router = setup.backend.routing
    hashes = hash_blocks(PROMPT, router.block_size, router.root)
    assert len(hashes) == 2
    setup.backend.index.apply(KVEvent("d1", tuple(hashes), ()))
    tokens, result = run(collect(setup))
    assert tokens == [31, 32]
    assert setup.cluster.start_calls == ["d1"]
    assert setup.cluster.prefill_calls == []
    assert (result.prefill_worker, result.decode_worker) == ("d1", "d1")
    assert setup.cluster.aborts == []
    assert_clean(setup)


def test_a_failed_start_full_is_aborted_and_tried_on_the_other_worker():
    async def fail(t: Try) -> None:
        raise WorkerLost(t.decode_worker, "actor died")

    setup = make_backend([fail, _serve_full], colocated=True)
    tokens, result = run(collect(setup))
    first, second = setup.cluster.tries
    assert tokens == [31, 32]
    assert second.decode_worker != first.decode_worker
    assert result.decode_worker == second.decode_worker
    assert setup.cluster.aborts == [(first.decode_worker, rid_of(first))]
    assert_clean(setup)


# ---- 5. the client goes away -------------------------------------------------


@pytest.mark.parametrize("prefill_done", [True, False], ids=["after_prefill", "during_prefill"])
def test_a_client_that_closes_early_aborts_the_try(prefill_done):
    """Closing the generator after the first token aborts the try on the
    decode worker, and on the prefill worker too while its call still runs."""
    never, cancelled = asyncio.Event(), asyncio.Event()

    async def serve(t: Try) -> PrefillResult:
        t.push(11)
        t.push(12)  # more would follow; the client leaves first
        if not prefill_done:
            try:
                await never.wait()
            except asyncio.CancelledError:
                cancelled.set()  # the router stopped waiting for the call
                raise
        return t.result()

    setup = make_backend([serve])

    async def main():
        gen = setup.backend.generate(GenerateInput("req", PROMPT, PARAMS))
        first = await anext(gen)
        await gen.aclose()
        if not prefill_done:
            await cancelled.wait()
        await settle(setup)
        return first

    first = run(main())
    (t,) = setup.cluster.tries
    assert isinstance(first, TokenDelta) and first.token_ids[0] == 11
    expected = [(t.decode_worker, rid_of(t))]
    if not prefill_done:
        expected.insert(0, (t.prefill_worker, rid_of(t)))
    assert setup.cluster.aborts == expected
    assert setup.cluster.prefill_calls == [t.prefill_worker]
    assert setup.backend.failover.retries == 0
    assert_clean(setup)
