"""A small async client for the router's ``Generate`` and ``GetModelInfo`` API.

    async with TandemClient(["10.0.0.1:50051", "10.0.0.2:50051"], timeout_s=30) as client:
        info = await client.model_info()  # name, vocab_size, max_model_len, ...
        async for response in client.generate("Hello", max_tokens=8):
            ...
        completion = await client.complete([1, 2, 3], temperature=0)

Sampling keywords are the ``GenerateRequest`` field names (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``frequency_penalty``, ``presence_penalty``, ``seed``, ``stop``,
``stop_token_ids``, ``ignore_eos``, ``logprobs``, ``request_id``); a keyword
left at None keeps the server default.

With API keys on the server, the client sends ``api_key``, else
``$TANDEM_API_KEY``, as ``authorization: Bearer <key>``.

Given several routers (of one deployment), the client survives the loss of
the one carrying a request: a stream that breaks goes on at the next router,
which resumes after the tokens already received (router/client_failover.py),
so the caller sees one uninterrupted stream. A single router is tried once.

Errors surface as ``grpc.aio.AioRpcError``: ``.code()`` is the status
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE, ...)
and ``.details()`` the server's message; when several tries failed, a
``RoutersFailed`` whose details list what each router answered.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc

from .auth import client_metadata
from .client_failover import Resume, router_lost
from .model_info import ModelInfo

MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class Completion:
    """A whole response, collected from the stream."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: pb.Usage
    timings: pb.Timings
    request_id: str = ""
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


def build_request(
    prompt: str | Sequence[int], *, stop: str | Sequence[str] | None = None, **sampling: object
) -> pb.GenerateRequest:
    """A GenerateRequest; None values are left unset (the server default).

    Raises TypeError for an unknown keyword or a prompt of the wrong type.
    """
    if isinstance(prompt, str):
        request = pb.GenerateRequest(prompt=prompt)
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        request = pb.GenerateRequest(prompt_token_ids=list(prompt))
    else:
        raise TypeError("prompt must be a str or a sequence of token ids")
    if stop is not None:
        request.stop.extend([stop] if isinstance(stop, str) else stop)
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for name, value in sampling.items():
        if name not in fields or name in ("prompt", "prompt_token_ids", "stop"):
            raise TypeError(f"unknown sampling keyword {name!r}")
        if value is None:
            continue
        if fields[name].is_repeated:
            getattr(request, name).extend(value)  # type: ignore[call-overload]
        else:
            setattr(request, name, value)
    return request


def collect(responses: Sequence[pb.GenerateResponse]) -> Completion:
    """A Completion from a finished stream (chunks, then one final)."""
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[pb.TokenLogprob] = []
    final: pb.GenerateFinal | None = None
    for r in responses:
        if r.HasField("chunk"):
            text.append(r.chunk.text)
            token_ids.extend(r.chunk.token_ids)
            logprobs.extend(r.chunk.logprobs)
        elif r.HasField("final"):
            final = r.final
    if final is None:
        raise RuntimeError("the stream ended without a final message")
    return Completion(
        text="".join(text),
        token_ids=token_ids,
        finish_reason=final.finish_reason,
        usage=final.usage,
        timings=final.timings,
        request_id=final.request_id,
        logprobs=logprobs,
    )


def open_channel(
    target: str,
    root_certificates: bytes | None = None,
    options: Sequence[tuple[str, int | str]] = (),
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to a router: TLS when ``root_certificates`` (PEM
    of the CA that signed the router's certificate) are given, else plaintext."""
    if root_certificates is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.aio.secure_channel(target, creds, options=list(options))


class TandemClient:
    """Async client over one ``grpc.aio`` channel per router; use as an async
    context manager."""

    def __init__(
        self,
        target: str | Sequence[str],
        timeout_s: float | None = None,
        api_key: str | None = None,
        *,
        root_certificates: bytes | None = None,
        options: Sequence[tuple[str, int | str]] = (),
        max_attempts: int | None = None,
    ) -> None:
        """``target``: a router's ``host:port``, or several (routers of one
        deployment): new requests start at each in turn (round robin), and a
        request whose router is lost moves to the next. ``timeout_s`` bounds a
        request over all its
        tries. ``api_key``: sent as ``authorization: Bearer``, else
        $TANDEM_API_KEY. ``root_certificates`` (PEM): talk TLS to routers
        serving it, trusting that CA. ``options``: extra gRPC channel options.
        ``max_attempts``: tries of one request (None: one with one router, two
        rounds of the routers with several). Raises ValueError for no target."""
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets or not all(self.targets):
            raise ValueError("TandemClient needs at least one router address")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.target = self.targets[0]
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts or (1 if len(self.targets) == 1 else 2 * len(self.targets))
        self._metadata = client_metadata(api_key)  # api_key, else $TANDEM_API_KEY
        self.root_certificates = root_certificates
        self.options = list(options)
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[generate_pb2_grpc.TandemStub] = []
        self._next = 0  # the router a new request tries first (round robin)

    @property
    def _channel(self) -> grpc.aio.Channel | None:
        return self._channels[0] if self._channels else None

    @property
    def _stub(self) -> generate_pb2_grpc.TandemStub | None:
        return self._stubs[0] if self._stubs else None

    async def __aenter__(self) -> TandemClient:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *self.options,
        ]
        self._channels = [open_channel(t, self.root_certificates, options) for t in self.targets]
        self._stubs = [generate_pb2_grpc.TandemStub(c) for c in self._channels]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels, self._stubs = self._channels, [], []
        for channel in channels:
            await channel.close()

    def _check_open(self) -> None:
        if not self._stubs:
            raise RuntimeError("TandemClient is not open; use `async with TandemClient(...)`")

    async def generate(
        self, prompt: str | Sequence[int], **sampling: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses: chunks, then one final. Leaving the loop early
        cancels the call (the server aborts the request). A router lost
        mid-stream: the stream goes on from the next router."""
        self._check_open()
        request = build_request(prompt, **sampling)
        if not request.request_id:  # one id on every router the request meets
            request.request_id = uuid.uuid4().hex
        resume = Resume(request, self.max_attempts)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        first, self._next = self._next, (self._next + 1) % len(self._stubs)
        while True:
            i = (first + len(resume.answers)) % len(self._stubs)
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            call = self._stubs[i].Generate(
                resume.next_request(), timeout=timeout, metadata=self._metadata
            )
            try:
                async for response in call:
                    if response.HasField("final"):
                        yield response
                        return
                    resume.received.extend(response.chunk.token_ids)
                    yield response
                error = None
                lost = (grpc.StatusCode.UNAVAILABLE, "the stream ended without a final message")
            except grpc.aio.AioRpcError as e:
                if not router_lost(e, resume.resumed):
                    raise
                error, lost = e, (e.code(), e.details() or "")
            finally:
                call.cancel()  # a no-op once the call has finished
            if not resume.failed(self.targets[i], *lost):
                if error is not None and len(resume.answers) == 1:
                    raise error  # one try: the router's own answer
                raise resume.error()
            await asyncio.sleep(resume.backoff_s(len(self._stubs)))

    async def complete(self, prompt: str | Sequence[int], **sampling: object) -> Completion:
        """The whole response, collected."""
        return collect([r async for r in self.generate(prompt, **sampling)])

    async def model_info(self) -> ModelInfo:
        """The served model's name and limits (``GetModelInfo``), from the first
        router that answers."""
        self._check_open()
        error: grpc.aio.AioRpcError | None = None
        for stub in self._stubs:
            try:
                reply = await stub.GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=self.timeout_s, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as e:
                if not router_lost(e, resumed=False):
                    raise
                error = e
                continue
            return ModelInfo.from_proto(reply)
        assert error is not None
        raise error


def generate_sync(
    target: str | Sequence[str],
    prompt: str | Sequence[int],
    timeout_s: float | None = None,
    **sampling: object,
) -> Completion:
    """One request from synchronous code (a script); not for use inside an event loop."""

    async def run() -> Completion:
        async with TandemClient(target, timeout_s) as client:
            return await client.complete(prompt, **sampling)

    return asyncio.run(run())
