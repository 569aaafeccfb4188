"""The FastAPI app of the HTTP front.

Routes: ``/health`` (open), ``/metrics`` (open, Prometheus text),
``/v1/models`` (the served model and its limits, as GetModelInfo gives
them), ``/v1/completions``, ``/v1/chat/completions`` (API key required
when keys are configured).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.auth import UNAUTHENTICATED_MESSAGE, ApiKeys
from router.backend import ManagedPools
from router.lifecycle import STARTING, Lifecycle
from router.messages import RequestError
from router.metrics import CONTENT_TYPE
from router.model_info import ModelInfo

from .chat import ChatTemplate
from .errors import OpenAIError, unauthenticated
from .generate import handle

log = logging.getLogger(__name__)
WORKER_STATS_TIMEOUT_S = 5.0


@dataclass
class FrontState:
    lifecycle: Lifecycle
    keys: ApiKeys
    model_name: str
    chat_template_file: str | Path | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _template: ChatTemplate | None = None

    def chat_template(self) -> ChatTemplate:
        """Built on first use: the backend's tokenizer exists once it has started."""
        if self._template is None:
            self._template = ChatTemplate(self.lifecycle.backend.tokenizer, self.chat_template_file)
        return self._template

    def model_card(self) -> dict:
        """OpenAI's model object plus the limits GetModelInfo gives (``max_model_len``,
        ``vocab_size``, ``has_tokenizer``, ``block_size``)."""
        openai = {"id": self.model_name, "object": "model", "created": self.created}
        return openai | {"owned_by": "tandem"} | ModelInfo.of(self.lifecycle.backend).card_fields()

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
            )

    async def refresh_worker_metrics(self) -> None:
        backend = self.lifecycle.backend
        if not isinstance(backend, ManagedPools) or self.lifecycle.unavailable == STARTING:
            return
        try:
            reports = await asyncio.wait_for(backend.worker_reports(), WORKER_STATS_TIMEOUT_S)
        except Exception as e:  # a scrape must not fail because one worker is slow or gone
            log.warning("worker stats for /metrics failed: %s", e)
            return
        self.lifecycle.metrics.set_workers(reports)


def create_app(state: FrontState) -> FastAPI:
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = state.lifecycle.metrics

    def refused(request: Request) -> Response | None:
        """A 401 response when the request lacks a valid key, else None."""
        if state.keys.check_header(request.headers.get("authorization")):
            return None
        metrics.auth_refused.inc()
        if request.url.path.endswith("completions"):
            metrics.requests.labels("http", "UNAUTHENTICATED").inc()
        return unauthenticated(UNAUTHENTICATED_MESSAGE).response()

    @app.get("/health")
    async def health() -> Response:
        if state.lifecycle.unavailable is not None:
            error = OpenAIError(503, state.lifecycle.unavailable, "service_unavailable")
            return error.response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        await state.refresh_worker_metrics()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        return JSONResponse({"object": "list", "data": [state.model_card()]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        return await handle(state, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        if (refusal := refused(request)) is not None:
            return refusal
        return await handle(state, request, "chat")

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> Response:
        message = f"no route {request.method} {request.url.path}"
        return OpenAIError(404, message, "invalid_request_error", None, "not_found").response()

    return app
