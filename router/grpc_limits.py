"""A bound on ``Generate`` requests by what the served model can use.

The gRPC server's own limit (``limits.max_message_mb``) is fixed when it
binds, before the backend has started and ``max_model_len`` is known. This
interceptor holds every ``Generate`` request to ``limit()`` bytes
(router/limits.py: ``generate_message_limit``) as it arrives: a bigger one
is refused with RESOURCE_EXHAUSTED before it is parsed, so it never turns
into the Python objects that parsing a large repeated field costs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class _TooBig:
    size: int
    limit: int


class GenerateSizeInterceptor(grpc.aio.ServerInterceptor):
    """Refuses ``method`` calls whose request message exceeds ``limit()`` bytes."""

    def __init__(self, method: str, limit: Callable[[], int]) -> None:
        self.method = method
        self.limit = limit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method != self.method or handler is None or handler.unary_stream is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_stream

        def deserialize(raw: bytes) -> object:
            limit = self.limit()
            if len(raw) > limit:
                return _TooBig(len(raw), limit)
            return parse(raw) if parse is not None else raw

        async def bounded(request: object, context: grpc.aio.ServicerContext) -> None:
            if isinstance(request, _TooBig):
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the request has {request.size} bytes; this model's requests need at most "
                    f"{request.limit} (max_model_len tokens, stop strings and the other fields)",
                )
            await behavior(request, context)

        return grpc.unary_stream_rpc_method_handler(
            bounded, deserialize, handler.response_serializer
        )
