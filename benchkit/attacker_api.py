"""Attacks on the router's public fronts: a control call without the admin
role, an oversized HTTP body, a flood of stop strings and a request that
drives the sampler to non-finite numbers. benchkit/attacker.py runs them
in a process of their own; each returns an ``Outcome``."""

from __future__ import annotations

import asyncio
import collections
import random
import select
import socket
import string
import urllib.parse

import grpc
import httpx

from benchkit.attack_outcome import Outcome
from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.auth import client_metadata
from router.client import TandemClient, open_channel

NAN_PROMPT = [13, 37, 13, 37]
"""The prompt start tests/faults.py's poisoned engines give NaN logits at prefill."""
NAN_LATE_PROMPT = [13, 37, 13, 38]
"""Likewise, once the request has two output tokens (tests/faults.py)."""
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
    """POST /v1/completions with a body of ``megabytes`` MB (a JSON completion
    request whose prompt is that long) over a raw socket, so that an answer
    the server sends before the body is all sent is read, not lost."""
    url = urllib.parse.urlsplit(http_url)
    # A model the server does not serve: a server that reads the whole body
    # answers 404 instead of tokenizing 100 MB (that would be another attack).
    head, tail = b'{"model": "no-such-model", "max_tokens": 1, "prompt": "', b'"}'
    size = megabytes << 20
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {size}\r\nConnection: close\r\n\r\n"
    ).encode()
    body = [
        head,
        *[b"a" * (1 << 20)] * (megabytes - 1),
        b"a" * ((1 << 20) - len(head) - len(tail)),
        tail,
    ]
    with socket.create_connection((url.hostname, url.port), timeout=120) as conn:
        sent = 0
        try:
            conn.sendall(request)
            for piece in body:
                if select.select([conn], [], [], 0)[0]:
                    break  # the server answered before the whole body
                conn.sendall(piece)
                sent += len(piece)
        except OSError:
            pass  # the server closed its end: its answer may be waiting
        return _http_answer(conn, sent)


def _http_answer(conn: socket.socket, sent: int) -> Outcome:
    reply = b""
    try:
        while len(reply) < 4096 and (data := conn.recv(4096)):
            reply += data
    except OSError:
        pass
    status_line, _, rest = reply.partition(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        return Outcome("dropped", f"no answer after {sent >> 20} MB of the body")
    text = rest.partition(b"\r\n\r\n")[2].decode(errors="replace")
    return Outcome(f"HTTP {int(parts[1])}", f"after {sent >> 20} MB of the body: {text}"[:200])


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
    return _counted(codes)


async def stop_flood_http(http_url: str, key: str, requests: int, distinct: int) -> Outcome:
    """``stop_flood`` on POST /v1/completions (a valid request otherwise)."""
    lists = [_stop_list(random.Random(i)) for i in range(distinct)]
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=http_url, headers=headers, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> str:
            body = {"model": model, "prompt": "Hello", "max_tokens": 4, "stop": lists[i % distinct]}
            try:
                return f"HTTP {(await client.post('/v1/completions', json=body)).status_code}"
            except httpx.HTTPError as e:
                return type(e).__name__

        codes = await asyncio.gather(*(one(i) for i in range(requests)))
    return _counted(codes)


def _counted(codes: list[str]) -> Outcome:
    counts = collections.Counter(codes)
    status = codes[0] if len(counts) == 1 else "mixed"
    return Outcome(status, ", ".join(f"{n} {code}" for code, n in sorted(counts.items())))


async def extreme_sampling(target: str, key: str) -> Outcome:
    """One request on the edges of every sampling bound (EXTREME_SAMPLING)."""
    return await _one_request(target, key, "def f(x):", **EXTREME_SAMPLING)


async def poisoned_prompt(target: str, key: str, late: bool = False) -> Outcome:
    """One sampled request whose prompt starts with NAN_PROMPT (NAN_LATE_PROMPT
    when ``late``): on workers whose engine tests/faults.py poisons, its
    logits turn NaN (as a broken KV block or kernel would make them); on any
    other, a plain request. The detail counts the tokens streamed first."""
    prompt = [*(NAN_LATE_PROMPT if late else NAN_PROMPT), 100, 200]
    streamed = 0
    async with TandemClient(target, timeout_s=120, api_key=key) as client:
        try:
            async for r in client.generate(prompt, max_tokens=8, temperature=1.0, seed=3):
                streamed += len(r.chunk.token_ids)
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code().name, f"{streamed} tokens streamed, then: {e.details()}"[:300])
    return Outcome("OK", f"{streamed} tokens")


async def _one_request(target: str, key: str, prompt, **sampling: object) -> Outcome:
    async with TandemClient(target, timeout_s=120, api_key=key) as client:
        try:
            done = await client.complete(prompt, max_tokens=8, **sampling)
        except grpc.aio.AioRpcError as e:
            return Outcome(e.code().name, (e.details() or "")[:200])
    return Outcome("OK", f"{len(done.token_ids)} tokens, finish {done.finish_reason}")
