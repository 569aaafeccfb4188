"""Attacks on the router's public fronts: a control call without the admin
role, an oversized HTTP body, a flood of stop strings and a request that
drives the sampler to non-finite numbers. benchkit/attacker.py runs them
in a process of their own; each returns an ``Outcome``."""

from __future__ import annotations

import asyncio
import collections
import random
import string

import grpc
import httpx

from benchkit.attacker_kv import Outcome
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.auth import client_metadata
from router.client import TandemClient, open_channel

STOP_STRINGS = 4096
STOP_CHARS = 256
EXTREME_SAMPLING: dict[str, object] = {
    # The edges of every bound the API accepts, on one sampled row.
    "temperature": 1.1e-5,
    "top_p": 1e-6,
    "min_p": 1.0,
    "repetition_penalty": 1e-30,
    "frequency_penalty": -2.0,
    "presence_penalty": -2.0,
    "seed": 7,
    "logprobs": 20,
}


async def scale(target: str, key: str | None, prefill: int, decode: int) -> Outcome:
    """Admin ``Scale`` to the given sizes with ``key`` (None: no key)."""
    async with open_channel(target) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            reply = await stub.Scale(
                admin_pb2.ScaleRequest(prefill=prefill, decode=decode),
                metadata=client_metadata(key) if key else (),
                timeout=120,
            )
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code().name, (e.details() or "")[:200])
    return Outcome("OK", f"scaled to prefill {reply.prefill}, decode {reply.decode}")


def big_body(http_url: str, key: str, megabytes: int) -> Outcome:
    """POST /v1/completions with a body of ``megabytes`` MB (a valid JSON
    completion request whose prompt is that long)."""
    head, tail = b'{"model": "m", "max_tokens": 1, "prompt": "', b'"}'
    size = (megabytes << 20) - len(head) - len(tail)

    def body():
        yield head
        chunk = b"a" * (1 << 20)
        for start in range(0, size, len(chunk)):
            yield chunk[: min(len(chunk), size - start)]
        yield tail

    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    try:
        reply = httpx.post(
            f"{http_url}/v1/completions", content=body(), headers=headers, timeout=300
        )
    except httpx.HTTPError as e:
        return Outcome("dropped", f"{type(e).__name__}: {e}"[:200])
    return Outcome(f"HTTP {reply.status_code}", reply.text[:200])


def _stop_list(rng: random.Random) -> list[str]:
    alphabet = string.ascii_letters + string.digits
    return ["".join(rng.choices(alphabet, k=STOP_CHARS)) for _ in range(STOP_STRINGS)]


async def stop_flood(target: str, key: str, requests: int, distinct: int) -> Outcome:
    """``requests`` concurrent requests of STOP_STRINGS stop strings of
    STOP_CHARS characters each, ``distinct`` different lists among them."""
    lists = [_stop_list(random.Random(i)) for i in range(distinct)]

    async def one(client: TandemClient, i: int) -> str:
        try:
            await client.complete("Hello", stop=lists[i % distinct], max_tokens=4)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return "OK"

    async with TandemClient(target, timeout_s=300, api_key=key) as client:
        codes = await asyncio.gather(*(one(client, i) for i in range(requests)))
    counts = collections.Counter(codes)
    status = codes[0] if len(counts) == 1 else "mixed"
    return Outcome(status, ", ".join(f"{n} {code}" for code, n in sorted(counts.items())))


async def extreme_sampling(target: str, key: str) -> Outcome:
    """One request on the edges of every sampling bound (EXTREME_SAMPLING)."""
    async with TandemClient(target, timeout_s=120, api_key=key) as client:
        try:
            done = await client.complete("def f(x):", max_tokens=8, **EXTREME_SAMPLING)
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code().name, (e.details() or "")[:200])
    return Outcome("OK", f"{len(done.token_ids)} tokens, finish {done.finish_reason}")
