"""Request bodies of the OpenAI-compatible endpoints.

Field names and defaults follow OpenAI's API; tandem's extensions (the same
names as the gRPC ``GenerateRequest``) are ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``return_token_ids`` (adds each chunk's ``token_ids`` to its choice),
``cache_salt`` (vLLM's prefix-cache domain), ``resume_token_ids`` (go on
after the tokens a broken stream delivered: router/resume.py) and
``priority`` (the admission queue's order, higher first).
Unknown fields are ignored, as OpenAI clients often send a few extra.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.sampling import MAX_LOGPROBS

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    """Send one more chunk, with empty choices and the usage, before [DONE]."""


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # tandem extensions (vLLM's names)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    return_token_ids: bool = False
    cache_salt: str | None = None
    """Prefix-cache domain (vLLM's name and type); checked with the gRPC field's rules."""
    resume_token_ids: list[TokenId] | None = None
    """The token ids a broken stream of this request delivered: the router
    generates after them (checked with the gRPC field's rules)."""
    priority: int | None = Field(None, ge=-INT32_MAX - 1, le=INT32_MAX, strict=True)
    """Order in the router's admission queue while no decode worker has room: higher
    first, first come first served within a priority; None: 0."""

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    response_format: dict | None = None
