"""A small async client for the router's ``Generate`` and ``GetModelInfo`` API.

    async with TandemClient("127.0.0.1:50051", timeout_s=30) as client:
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

Errors surface as ``grpc.aio.AioRpcError``: ``.code()`` is the status
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, UNAVAILABLE, ...)
and ``.details()`` the server's message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from protos.tandem.v1 import generate_pb2 as pb
from protos.tandem.v1 import generate_pb2_grpc

from .auth import client_metadata
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
    """Async client over one ``grpc.aio`` channel; use as an async context manager."""

    def __init__(
        self,
        target: str,
        timeout_s: float | None = None,
        api_key: str | None = None,
        *,
        root_certificates: bytes | None = None,
        options: Sequence[tuple[str, int | str]] = (),
    ) -> None:
        """``api_key``: sent as ``authorization: Bearer``, else $TANDEM_API_KEY.
        ``root_certificates`` (PEM): talk TLS to a router serving it, trusting
        that CA. ``options``: extra gRPC channel options."""
        self.target = target
        self.timeout_s = timeout_s
        self._metadata = client_metadata(api_key)  # api_key, else $TANDEM_API_KEY
        self.root_certificates = root_certificates
        self.options = list(options)
        self._channel: grpc.aio.Channel | None = None
        self._stub: generate_pb2_grpc.TandemStub | None = None

    async def __aenter__(self) -> TandemClient:
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *self.options,
        ]
        self._channel = open_channel(self.target, self.root_certificates, options)
        self._stub = generate_pb2_grpc.TandemStub(self._channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def generate(
        self, prompt: str | Sequence[int], **sampling: object
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the responses: chunks, then one final. Leaving the loop early
        cancels the call (the server aborts the request)."""
        if self._stub is None:
            raise RuntimeError("TandemClient is not open; use `async with TandemClient(...)`")
        call = self._stub.Generate(
            build_request(prompt, **sampling), timeout=self.timeout_s, metadata=self._metadata
        )
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # a no-op once the call has finished

    async def complete(self, prompt: str | Sequence[int], **sampling: object) -> Completion:
        """The whole response, collected."""
        return collect([r async for r in self.generate(prompt, **sampling)])

    async def model_info(self) -> ModelInfo:
        """The served model's name and limits (``GetModelInfo``)."""
        if self._stub is None:
            raise RuntimeError("TandemClient is not open; use `async with TandemClient(...)`")
        reply = await self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self.timeout_s, metadata=self._metadata
        )
        return ModelInfo.from_proto(reply)


def generate_sync(
    target: str, prompt: str | Sequence[int], timeout_s: float | None = None, **sampling: object
) -> Completion:
    """One request from synchronous code (a script); not for use inside an event loop."""

    async def run() -> Completion:
        async with TandemClient(target, timeout_s) as client:
            return await client.complete(prompt, **sampling)

    return asyncio.run(run())
