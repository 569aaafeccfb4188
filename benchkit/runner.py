"""Replay a workload against a router and record what the client sees.

Open loop (``rate``): conversations start at gamma/Poisson arrival times
whether or not earlier ones have finished. Closed loop (``concurrency``):
that many workers each run one conversation at a time. Turns of a
conversation go back to back: turn k+1 is sent when turn k's answer is in.

``num_requests`` counts requests (turns), so a run sends exactly that many
(the last conversation may be cut short); with ``duration_s`` no request
starts after that many seconds. Requests in flight are always awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import httpx

from benchkit.http_client import HttpSender, http_model_info, http_ready, is_http
from benchkit.metrics import OK, FinalInfo, RequestRecord
from benchkit.schedule import RateSchedule
from benchkit.workload import Conversation, Prompt, interarrival_gaps, next_turn_prompt
from router.client import TandemClient, open_channel
from router.model_info import ModelInfo


@dataclass
class LoadSpec:
    rate: float | None = None  # requests (conversations) per second; open loop
    burstiness: float = 1.0
    concurrency: int | None = None  # closed loop
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    schedule: RateSchedule | None = None  # open loop at a rate that changes over time

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.rate, self.concurrency, self.schedule)]
        if sum(given) != 1:
            raise ValueError("give exactly one of rate, concurrency and schedule")
        if self.schedule is not None and self.duration_s is None:
            self.duration_s = self.schedule.duration_s
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests or duration_s (or both)")

    def arrival_offsets(self) -> Iterator[float]:
        """Open loop: when each conversation starts (s from the run's start)."""
        if self.schedule is not None:
            yield from self.schedule.arrivals(self.seed, self.burstiness)
            return
        assert self.rate is not None
        t = 0.0
        for gap in interarrival_gaps(self.rate, self.burstiness, self.seed):
            yield t
            t += gap


class _Budget:
    def __init__(self, num_requests: int | None, duration_s: float | None, start: float) -> None:
        self.left = num_requests
        self.deadline = None if duration_s is None else start + duration_s

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def over(self, at: float) -> bool:
        """Whether nothing may start at time ``at``."""
        return self.left == 0 or (self.deadline is not None and at >= self.deadline)

    def take(self, want: int) -> int:
        """Reserve up to ``want`` requests; 0 when the run is over."""
        if self.expired():
            return 0
        if self.left is None:
            return want
        got = min(want, self.left)
        self.left -= got
        return got


async def send_one(
    client: TandemClient,
    prompt: Prompt,
    max_tokens: int,
    *,
    temperature: float,
    index: int = 0,
    conversation: int = 0,
    turn: int = 0,
) -> tuple[RequestRecord, Prompt]:
    """One streamed request: its record and its answer (token ids for a
    token-id prompt, text for a text prompt)."""
    rec = RequestRecord(
        send_time=time.perf_counter(),
        index=index,
        conversation=conversation,
        turn=turn,
        input_len=0 if isinstance(prompt, str) else len(prompt),
    )
    ids: list[int] = []
    text: list[str] = []
    try:
        async for r in client.generate(
            prompt, temperature=temperature, max_tokens=max_tokens, ignore_eos=True
        ):
            now = time.perf_counter()
            if r.HasField("chunk"):
                rec.chunks.append((now, len(r.chunk.token_ids)))
                ids.extend(r.chunk.token_ids)
                text.append(r.chunk.text)
            elif r.HasField("final"):
                u, t = r.final.usage, r.final.timings
                rec.final = FinalInfo(
                    prompt_tokens=u.prompt_tokens,
                    cached_tokens=u.cached_tokens,
                    completion_tokens=u.completion_tokens,
                    ttft_s=t.ttft_s,
                    mean_tpot_s=t.mean_tpot_s,
                    prefill_worker=t.prefill_worker,
                    decode_worker=t.decode_worker,
                    finish_reason=r.final.finish_reason,
                )
        rec.end_time = time.perf_counter()
        if rec.final is None:
            rec.status, rec.error = "NO_FINAL", "the stream ended without a final message"
        elif rec.final.finish_reason == "abort":
            rec.status, rec.error = "ABORTED", "finish_reason=abort"
    except grpc.aio.AioRpcError as e:
        rec.end_time = time.perf_counter()
        rec.status, rec.error = e.code().name, e.details() or ""
    except Exception as e:  # a client-side failure still counts as a failed request
        rec.end_time = time.perf_counter()
        rec.status, rec.error = type(e).__name__, str(e)
    return rec, ("".join(text) if isinstance(prompt, str) else ids)


async def run_load(
    target: str,
    conversations: Iterator[Conversation],
    load: LoadSpec,
    *,
    temperature: float = 0.0,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    root_certificates: bytes | None = None,
    on_start: Callable[[float], None] | None = None,
) -> list[RequestRecord]:
    """Run one load against ``target``; the records in completion order.
    ``root_certificates`` (PEM of a CA): gRPC over TLS. ``on_start`` is
    called with the run's start (``time.perf_counter``), in the run's loop."""
    records: list[RequestRecord] = []
    counter = iter(range(1 << 62))
    start = time.perf_counter()
    if on_start is not None:
        on_start(start)
    budget = _Budget(load.num_requests, load.duration_s, start)

    async with _sender(target, timeout_s, root_certificates) as send:

        async def conversation(conv: Conversation, n_turns: int) -> None:
            prompt: Prompt = conv.turns[0].message
            answer: Prompt = []
            for k in range(n_turns):
                if k > 0:
                    if budget.expired():
                        return
                    prompt = next_turn_prompt(prompt, answer, conv.turns[k].message)
                rec, answer = await send(
                    prompt,
                    conv.turns[k].max_tokens,
                    temperature=temperature,
                    index=next(counter),
                    conversation=conv.index,
                    turn=k,
                )
                records.append(rec)
                if on_done is not None:
                    on_done(rec)
                if rec.status != OK:
                    return

        if load.concurrency is not None:

            async def worker() -> None:
                for conv in conversations:
                    n = budget.take(len(conv.turns))
                    if n == 0:
                        return
                    await conversation(conv, n)

            await asyncio.gather(*(worker() for _ in range(load.concurrency)))
        else:
            tasks = []
            for conv, offset in zip(conversations, load.arrival_offsets(), strict=False):
                next_at = start + offset
                if budget.over(next_at):
                    break
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                n = budget.take(len(conv.turns))
                if n == 0:
                    break
                tasks.append(asyncio.create_task(conversation(conv, n)))
            await asyncio.gather(*tasks)
    return records


class _GrpcSender:
    def __init__(self, target: str, timeout_s: float | None, ca: bytes | None) -> None:
        self.client = TandemClient(target, timeout_s=timeout_s, root_certificates=ca)

    async def __aenter__(self):
        await self.client.__aenter__()
        return self.send

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    async def send(self, prompt: Prompt, max_tokens: int, **kw) -> tuple[RequestRecord, Prompt]:
        return await send_one(self.client, prompt, max_tokens, **kw)


class _HttpSender(HttpSender):
    async def __aenter__(self):
        await super().__aenter__()
        return self.send


def _sender(target: str, timeout_s: float | None, ca: bytes | None):
    """An async context giving ``send(prompt, max_tokens, temperature=, index=, ...)``:
    gRPC for ``host:port``, the HTTP front for ``http://host:port``."""
    if is_http(target):
        return _HttpSender(target, timeout_s)
    return _GrpcSender(target, timeout_s, ca)


class ModelInfoError(Exception):
    """The target did not say what model it serves; the message says why."""


async def fetch_model_info(
    target: str, timeout_s: float = 10.0, root_certificates: bytes | None = None
) -> ModelInfo:
    """The served model and its limits: ``GetModelInfo`` over gRPC, ``/v1/models``
    over HTTP (both with $TANDEM_API_KEY). Raises ModelInfoError."""
    if is_http(target):
        try:
            return await http_model_info(target, timeout_s)
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
            raise ModelInfoError(f"/v1/models: {type(e).__name__}: {e}") from None
    async with TandemClient(target, timeout_s, root_certificates=root_certificates) as client:
        try:
            return await client.model_info()
        except grpc.aio.AioRpcError as e:
            raise ModelInfoError(_rpc_problem(e)) from None


def _rpc_problem(e: grpc.aio.AioRpcError) -> str:
    message = f"GetModelInfo: {e.code().name}: {e.details()}"
    if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        message += " (a router older than GetModelInfo?)"
    return message


async def wait_ready(
    target: str, timeout_s: float = 10.0, root_certificates: bytes | None = None
) -> bool:
    """Whether ``target`` answers within ``timeout_s``: a gRPC channel connects
    (over TLS with ``root_certificates``), or the HTTP front's /health says ok."""
    if is_http(target):
        return await http_ready(target, timeout_s)
    async with open_channel(target, root_certificates) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
        except TimeoutError:
            return False
    return True
