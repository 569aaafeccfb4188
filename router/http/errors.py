"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Router refusals (``RequestError``, gRPC status codes) map to HTTP statuses:
INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, ALREADY_EXISTS 409,
RESOURCE_EXHAUSTED 429, INTERNAL 500, UNAVAILABLE 503, DEADLINE_EXCEEDED 504.
A body past ``limits.max_http_body_mb`` gets 413.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from fastapi.responses import JSONResponse

from router.messages import RequestError

_HTTP_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


@dataclass(frozen=True)
class OpenAIError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_request_error(e: RequestError, param: str | None = None) -> OpenAIError:
    status, kind = _HTTP_OF_CODE.get(e.code, (500, "internal_error"))
    return OpenAIError(status, e.message, kind, param, e.code.name.lower())


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_argument")


def unauthenticated(message: str) -> OpenAIError:
    return OpenAIError(401, message, "authentication_error", None, "invalid_api_key")


def too_large(message: str) -> OpenAIError:
    return OpenAIError(413, message, "invalid_request_error", None, "request_too_large")
