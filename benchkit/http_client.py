"""``tandem bench`` against the OpenAI-compatible HTTP front.

Each request is a streamed ``/v1/completions`` call (``stream_options.
include_usage`` for the usage, tandem's ``return_token_ids`` extension for
each chunk's token count, so TTFT, TPOT and ITL are measured exactly as over
gRPC). Token-id prompts are sent as OpenAI token arrays.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchkit.metrics import FinalInfo, RequestRecord
from benchkit.workload import Prompt
from router.auth import client_headers
from router.model_info import ModelInfo


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


class HttpSender:
    """One HTTP connection pool to the front; ``send`` runs one request."""

    def __init__(self, base_url: str, timeout_s: float | None, model: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=client_headers(),  # $TANDEM_API_KEY, when set
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    async def __aenter__(self) -> HttpSender:
        if self.model is None:
            self.model = await served_model(self._client)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def send(
        self, prompt: Prompt, max_tokens: int, *, temperature: float, **where: int
    ) -> tuple[RequestRecord, Prompt]:
        rec = RequestRecord(
            send_time=time.perf_counter(),
            input_len=0 if isinstance(prompt, str) else len(prompt),
            **where,
        )
        payload = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        ids: list[int] = []
        text: list[str] = []
        try:
            async with self._client.stream("POST", "/v1/completions", json=payload) as reply:
                if reply.status_code != 200:
                    error = json.loads(await reply.aread()).get("error", {})
                    rec.status = str(error.get("code") or reply.status_code).upper()
                    rec.error = error.get("message", "")
                else:
                    await self._read(reply, rec, ids, text)
        except (httpx.HTTPError, ValueError) as e:
            rec.status, rec.error = type(e).__name__, str(e)
        rec.end_time = time.perf_counter()
        return rec, ("".join(text) if isinstance(prompt, str) else ids)

    @staticmethod
    async def _read(
        reply: httpx.Response, rec: RequestRecord, ids: list[int], text: list[str]
    ) -> None:
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            now = time.perf_counter()
            if "error" in event:
                rec.status = str(event["error"].get("code") or "ERROR").upper()
                rec.error = event["error"].get("message", "")
                return
            for choice in event.get("choices", ()):
                if choice.get("finish_reason"):
                    rec.final = rec.final or FinalInfo()
                    rec.final.finish_reason = choice["finish_reason"]
                token_ids = choice.get("token_ids") or []
                if token_ids or choice.get("text"):
                    rec.chunks.append((now, len(token_ids)))
                    ids.extend(token_ids)
                    text.append(choice.get("text", ""))
            usage = event.get("usage")
            if usage:
                rec.final = rec.final or FinalInfo()
                rec.final.prompt_tokens = usage["prompt_tokens"]
                rec.final.completion_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                rec.final.cached_tokens = details.get("cached_tokens", 0)
        if rec.final is None:
            rec.status, rec.error = "NO_FINAL", "the stream ended without a finish reason"
        elif rec.final.finish_reason == "abort":
            rec.status, rec.error = "ABORTED", "finish_reason=abort"


async def served_model(client: httpx.AsyncClient) -> str:
    return (await served_model_info(client)).name


async def served_model_info(client: httpx.AsyncClient) -> ModelInfo:
    """The first model /v1/models lists, with its limits. Raises httpx.HTTPError,
    or KeyError, IndexError, TypeError or ValueError for a reply of another shape."""
    reply = await client.get("/v1/models")
    reply.raise_for_status()
    return ModelInfo.from_card(reply.json()["data"][0])


async def http_model_info(base_url: str, timeout_s: float) -> ModelInfo:
    """:func:`served_model_info` of the front at ``base_url`` (sends $TANDEM_API_KEY)."""
    async with httpx.AsyncClient(
        base_url=base_url, headers=client_headers(), timeout=timeout_s
    ) as client:
        return await served_model_info(client)


async def http_ready(base_url: str, timeout_s: float = 10.0) -> bool:
    """Whether the front answers /health with 200 within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get("/health")).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return False
