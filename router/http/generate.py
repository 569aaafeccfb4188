"""``/v1/completions`` and ``/v1/chat/completions``: parse, validate, run, respond.

A request goes through the same ``Lifecycle`` as a gRPC call (admission,
request-id claim, deadline, metrics, status count). With ``stream=true``
the answer is server-sent events: one chunk per backend delta, a chunk with
the finish reason, a usage chunk when ``stream_options.include_usage``, then
``data: [DONE]``. A failure after the stream began is sent as an event
``data: {"error": {...}}`` before ``[DONE]``; so is RESOURCE_EXHAUSTED for a
client that reads too slowly (router/backpressure.py). A client that
disconnects cancels the request, which frees its blocks on every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.types import Message, Send

from router.backend import GenerateResult, TokenDelta
from router.backpressure import SlowClient, UnreadOutput
from router.lifecycle import Call, short
from router.messages import RequestError, check_request_id, invalid_argument, to_generate_input

from .convert import chat_request, completion_request
from .errors import from_request_error, invalid, too_large
from .responses import Formatter, Kind
from .schemas import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from .app import FrontState

log = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    """A request body past ``limits.max_http_body_mb`` (HTTP 413)."""


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


async def _read_body(raw: Request, limit: int) -> bytes:
    """The body, refused (BodyTooLarge) past ``limit`` bytes before it is read: by
    its Content-Length, and by count as it arrives (a chunked body has none)."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body has {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body has more than {limit} bytes, the limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parse(kind: Kind, raw: bytes) -> CompletionRequest | ChatCompletionRequest:
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)  # no NaN or Infinity
    except (ValueError, RecursionError):
        raise invalid_argument("the request body is not valid JSON") from None
    if b"\\ud" in raw.lower():  # an escaped surrogate: refuse a lone one
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid_argument(
                "the request body holds a lone UTF-16 surrogate (not valid Unicode)"
            ) from None
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(data)
    except RecursionError:
        raise invalid_argument("the request body is nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {err['msg']}") from None


async def handle(state: FrontState, raw: Request, kind: Kind) -> Response:
    rid = raw.headers.get("x-request-id") or uuid.uuid4().hex
    try:
        check_request_id("x-request-id", rid)
    except RequestError as e:
        return invalid(e.message).response()
    lifecycle = state.lifecycle
    call = lifecycle.begin("http")
    try:
        call.admit(state.keys.identity(raw.headers.get("authorization")))
        body = _parse(kind, await _read_body(raw, lifecycle.limits.max_http_body_bytes))
        state.check_model(body.model)
        if isinstance(body, ChatCompletionRequest):
            request = await chat_request(body, rid, state.chat_template(), lifecycle.backend)
        else:
            request = completion_request(body, rid)
        tenant = lifecycle.cache_domains.tenant(raw.headers.get("authorization"))
        inp = await to_generate_input(
            request, lifecycle.backend, call.start, tenant, lifecycle.limits
        )
        call.claim(inp)
    except BodyTooLarge as e:
        call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED)
        return too_large(str(e)).response({"connection": "close"})
    except RequestError as e:
        call.finish(e.code)
        return from_request_error(e).response()
    except Exception as e:
        log.exception("HTTP request %s failed before generation", rid)
        call.finish(grpc.StatusCode.INTERNAL)
        return from_request_error(
            RequestError(grpc.StatusCode.INTERNAL, f"request failed: {short(e)}")
        ).response()
    fmt = Formatter(
        kind,
        rid,
        body.model,
        state.lifecycle.backend.tokenizer,
        return_token_ids=body.return_token_ids,
        top_logprobs=bool(inp.params.logprobs),
    )
    timeout_s = state.lifecycle.timeout_s(None)
    headers = {"x-request-id": rid}
    if body.stream:
        events = _events(call, fmt, body.include_usage, timeout_s)
        return BoundedStream(events, call.unread, media_type="text/event-stream", headers=headers)
    return await _whole(call, fmt, timeout_s, headers, raw)


async def _events(
    call: Call, fmt: Formatter, include_usage: bool, timeout_s: float
) -> AsyncIterator[str]:
    code = grpc.StatusCode.CANCELLED  # unless it gets further
    try:
        if fmt.kind == "chat":
            yield _sse(fmt.role_chunk())
        async with call.deadline(timeout_s), contextlib.aclosing(call.stream()) as items:
            async for item in items:
                if isinstance(item, GenerateResult):
                    yield _sse(fmt.final_chunk(item))
                    if include_usage:
                        yield _sse(fmt.usage_chunk(item))
                else:
                    yield _sse(fmt.chunk(item))
        code = grpc.StatusCode.OK
        yield "data: [DONE]\n\n"
    except RequestError as e:
        code = e.code
        yield _sse(from_request_error(e).body())
        yield "data: [DONE]\n\n"
    except Exception as e:
        log.exception("streaming request %s failed", fmt.request_id)
        code = grpc.StatusCode.INTERNAL
        error = RequestError(code, f"request failed: {short(e)}")
        yield _sse(from_request_error(error).body())
        yield "data: [DONE]\n\n"
    finally:  # closed by BoundedStream: a write timed out
        slow = code == grpc.StatusCode.CANCELLED and call.unread.cut is not None
        call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED if slow else code)


class BoundedStream(StreamingResponse):
    """Server-sent events whose writes (uvicorn's ``send``, which waits while its
    transport buffer is full) are bounded by ``limits.slow_client_timeout_s``:
    past it the events stop, the request is aborted, and the connection is
    closed (no event reaches a client that reads nothing)."""

    def __init__(self, content: AsyncIterator[str], unread: UnreadOutput, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.unread = unread

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            async with self.unread.writing():
                await send(message)

        try:
            await super().stream_response(bounded)
        except SlowClient as e:
            log.warning("closing a stream: %s", e)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _whole(
    call: Call, fmt: Formatter, timeout_s: float, headers: dict, raw: Request
) -> Response:
    """The whole answer as one JSON body; a client that disconnects first cancels it."""
    deltas: list[TokenDelta] = []
    result: list[GenerateResult] = []

    async def collect() -> None:
        async with call.deadline(timeout_s), contextlib.aclosing(call.stream()) as items:
            async for item in items:
                (result if isinstance(item, GenerateResult) else deltas).append(item)

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client left: stop the request (its blocks are freed)
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            call.finish(grpc.StatusCode.CANCELLED)
            return Response(status_code=499)  # nobody reads it
        work.result()
    except RequestError as e:
        call.finish(e.code)
        return from_request_error(e).response(headers)
    except BaseException:
        work.cancel()
        call.finish(grpc.StatusCode.CANCELLED)
        raise
    finally:
        gone.cancel()
    call.finish(grpc.StatusCode.OK)
    return JSONResponse(fmt.whole(deltas, result[0]), headers=headers)


async def _disconnected(raw: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
