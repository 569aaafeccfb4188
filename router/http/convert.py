"""OpenAI request bodies -> the gRPC ``GenerateRequest`` the router validates.

The HTTP front builds the same message the gRPC API receives and runs it
through the same validation and tokenization (``router.messages``), in
process: both fronts refuse the same things with the same messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from protos.tandem.v1 import generate_pb2 as pb
from router.backend import Backend
from router.messages import SAMPLING_FIELDS, RequestError, check_prompt_bytes, invalid_argument

from .chat import ChatTemplate, encode_rendered, message_text
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_CHAT_TOP_LOGPROBS = 20
_TOKENIZE_IN_THREAD_CHARS = 16_384


def _refusal(name: str, e: Exception) -> RequestError:
    if isinstance(e, UnicodeError):
        return invalid_argument(f"{name}: not valid Unicode text (a lone surrogate)")
    return invalid_argument(f"{name}: out of range for the field")


def _set(request: pb.GenerateRequest, name: str, value: object) -> None:
    """``request.<name> = value``; a value the proto field cannot hold is the client's error."""
    try:
        setattr(request, name, value)
    except (ValueError, TypeError) as e:
        raise _refusal(name, e) from None


def _extend(request: pb.GenerateRequest, name: str, values: Iterable[object]) -> None:
    try:
        getattr(request, name).extend(values)
    except (ValueError, TypeError) as e:
        raise _refusal(name, e) from None


def _sampling(body: SamplingFields, request_id: str) -> pb.GenerateRequest:
    if body.n != 1:
        raise invalid_argument("n: only n=1 is supported")
    if body.logit_bias:
        raise invalid_argument("logit_bias is not supported")
    request = pb.GenerateRequest(request_id=request_id, ignore_eos=body.ignore_eos)
    for name in SAMPLING_FIELDS:  # OpenAI's logprobs differ: handled below
        value = None if name == "logprobs" else getattr(body, name)
        if value is not None:
            _set(request, name, value)
    if body.stop is not None:
        _extend(request, "stop", [body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        _extend(request, "stop_token_ids", body.stop_token_ids)
    if body.cache_salt is not None:
        request.cache_salt = body.cache_salt
    if body.resume_token_ids:
        _extend(request, "resume_token_ids", body.resume_token_ids)
    if body.priority is not None:
        request.priority = body.priority
    return request


def completion_request(body: CompletionRequest, request_id: str) -> pb.GenerateRequest:
    if body.echo:
        raise invalid_argument("echo is not supported")
    if body.suffix:
        raise invalid_argument("suffix is not supported")
    if body.best_of not in (None, 1):
        raise invalid_argument("best_of: only 1 is supported")
    request = _sampling(body, request_id)
    prompt = body.prompt
    if isinstance(prompt, str):
        _set(request, "prompt", prompt)
    elif prompt and all(isinstance(t, int) for t in prompt):
        _extend(request, "prompt_token_ids", prompt)
    elif isinstance(prompt, list) and len(prompt) == 1:
        one = prompt[0]
        if isinstance(one, str):
            _set(request, "prompt", one)
        else:
            _extend(request, "prompt_token_ids", one)
    else:
        raise invalid_argument("prompt: give one prompt (a string or a list of token ids)")
    if body.logprobs is not None:
        _set(request, "logprobs", body.logprobs)
    return request


async def chat_request(
    body: ChatCompletionRequest, request_id: str, template: ChatTemplate, backend: Backend
) -> pb.GenerateRequest:
    if body.tools:
        raise invalid_argument("tools are not supported")
    if body.response_format and body.response_format.get("type") not in (None, "text"):
        raise invalid_argument("response_format: only text is supported")
    tokenizer = backend.tokenizer
    if tokenizer is None:
        raise invalid_argument("messages: chat needs a tokenizer; this server has none")
    request = _sampling(body, request_id)
    if body.max_completion_tokens is not None:
        _set(request, "max_tokens", body.max_completion_tokens)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise invalid_argument("top_logprobs needs logprobs=true")
        if body.top_logprobs > MAX_CHAT_TOP_LOGPROBS:
            raise invalid_argument(f"top_logprobs must be at most {MAX_CHAT_TOP_LOGPROBS}")
    if body.logprobs:
        request.logprobs = body.top_logprobs or 0
    check_prompt_bytes("messages", "".join(map(message_text, body.messages)), backend)
    text = template.render(body.messages)
    check_prompt_bytes("messages", text, backend)
    if len(text) > _TOKENIZE_IN_THREAD_CHARS:
        ids = await asyncio.to_thread(encode_rendered, tokenizer, text)
    else:
        ids = encode_rendered(tokenizer, text)
    if not ids:
        raise invalid_argument("messages: the chat template rendered no tokens")
    request.prompt_token_ids.extend(ids)
    return request
