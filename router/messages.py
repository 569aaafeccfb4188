"""Proto <-> backend types: request validation and tokenization, response messages.

Every refusal is a ``RequestError`` whose message names the offending field.
"""

from __future__ import annotations

import asyncio
import functools
import uuid

import grpc

from protocol.sampling import SamplingParams
from protos.tandem.v1 import generate_pb2 as pb

from .backend import Backend, GenerateInput, GenerateResult, TokenDelta
from .limits import RequestLimits, prompt_byte_limit
from .resume import resume_token_ids
from .tenancy import CacheDomains, Tenant, check_client_salt

DEFAULT_MAX_TOKENS = 16  # vLLM's default when a request leaves max_tokens unset
MAX_REQUEST_ID_CHARS = 256
_TOKENIZE_IN_THREAD_CHARS = 16_384  # longer prompts are tokenized off the event loop
_DETOKENIZE_IN_THREAD_TOKENS = 1024  # more resumed tokens with stop strings: off the loop too
SAMPLING_FIELDS = (  # proto fields with explicit presence, same names as SamplingParams
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logprobs",
)


class RequestError(Exception):
    """A request refused before it reached the backend."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RequestError:
    """A refusal with INVALID_ARGUMENT; the message names the field."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def sampling_params(
    request: pb.GenerateRequest, backend: Backend, limits: RequestLimits | None = None
) -> SamplingParams:
    """SamplingParams from a request; unset optional fields keep their defaults."""
    if (why := (limits or RequestLimits()).stop_error(list(request.stop))) is not None:
        raise invalid_argument(why)
    kwargs: dict[str, object] = {
        name: getattr(request, name) for name in SAMPLING_FIELDS if request.HasField(name)
    }
    kwargs.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    try:
        params = SamplingParams(
            **kwargs,
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        params.validate_for_vocab(backend.vocab_size)
    except ValueError as e:
        raise invalid_argument(str(e)) from None
    if params.stop and backend.tokenizer is None:
        raise invalid_argument(
            "stop strings need a tokenizer; this server has none (use stop_token_ids)"
        )
    return params


async def prompt_token_ids(request: pb.GenerateRequest, backend: Backend) -> list[int]:
    """The prompt as token ids, checked against the vocabulary and max_model_len."""
    has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
    if has_text == has_ids:
        raise invalid_argument(
            "prompt and prompt_token_ids are mutually exclusive"
            if has_text
            else "prompt is required: set one of prompt or prompt_token_ids"
        )
    field_name = "prompt" if has_text else "prompt_token_ids"
    if has_text:
        if backend.tokenizer is None:
            raise invalid_argument(
                "prompt text needs a tokenizer; this server has none (send token ids)"
            )
        check_prompt_bytes("prompt", request.prompt, backend)
        ids = await _tokenize(backend.tokenizer, request.prompt)
        if not ids:
            raise invalid_argument("prompt tokenizes to no tokens")
    else:
        ids = list(request.prompt_token_ids)
        vocab = backend.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_argument(
                f"prompt_token_ids[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab})"
            )
    limit = backend.max_model_len
    if len(ids) >= limit:
        raise invalid_argument(
            f"{field_name} has {len(ids)} tokens; the limit is {limit - 1} (max_model_len {limit})"
        )
    return ids


def check_prompt_bytes(field_name: str, text: str, backend: Backend) -> None:
    """Refuse, before tokenizing, a text longer than max_model_len tokens could encode."""
    limit = prompt_byte_limit(backend.tokenizer, backend.max_model_len)
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise invalid_argument(
            f"{field_name} is longer than {limit} bytes, more than max_model_len "
            f"{backend.max_model_len} tokens can hold"
        )


async def _tokenize(tokenizer, text: str) -> list[int]:
    if len(text) > _TOKENIZE_IN_THREAD_CHARS:
        return list(await asyncio.to_thread(tokenizer.encode, text))
    return list(tokenizer.encode(text))


def request_id_of(request: pb.GenerateRequest) -> str:
    """The client's request id, or a fresh one when unset or empty."""
    rid = request.request_id if request.HasField("request_id") else ""
    check_request_id("request_id", rid)
    return rid or uuid.uuid4().hex


def cache_salt_of(request: pb.GenerateRequest, tenant: Tenant) -> bytes:
    """The block-hash salt of the request's domain: ``tenant`` (router/tenancy.py)
    and its checked ``cache_salt``."""
    client_salt = request.cache_salt if request.HasField("cache_salt") else None
    if client_salt is not None:
        try:
            check_client_salt(client_salt)
        except ValueError as e:
            raise invalid_argument(str(e)) from None
    return tenant.salt(client_salt)


def check_request_id(field_name: str, rid: str) -> None:
    """A client's request id is logged and echoed: bounded, and printable only (no
    newline, control or format character can forge or hide a log line)."""
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(f"{field_name} must have at most {MAX_REQUEST_ID_CHARS} characters")
    if not rid.isprintable():
        raise invalid_argument(
            f"{field_name} must hold printable characters only (no control characters)"
        )


async def to_generate_input(
    request: pb.GenerateRequest,
    backend: Backend,
    received_s: float | None = None,
    tenant: Tenant | None = None,
    limits: RequestLimits | None = None,
) -> GenerateInput:
    """Validate and tokenize a request received at ``received_s`` (perf_counter;
    None: now) from ``tenant`` (None: none, under a random salt key), with the
    tokens of a resumed stream checked. Raises RequestError (INVALID_ARGUMENT)."""
    rid = request_id_of(request)
    params = sampling_params(request, backend, limits)
    salt = cache_salt_of(request, tenant or CacheDomains().tenant(None))
    ids = await prompt_token_ids(request, backend)
    resumed, finish = await resumed_tokens(request, ids, params, backend)
    timing = {} if received_s is None else {"received_s": received_s}
    priority = request.priority if request.HasField("priority") else 0
    return GenerateInput(
        rid, ids, params, cache_salt=salt, resume_token_ids=resumed, resumed_finish=finish,
        priority=priority, **timing,
    )  # fmt: skip


async def resumed_tokens(
    request: pb.GenerateRequest, prompt: list[int], params: SamplingParams, backend: Backend
) -> tuple[list[int], str | None]:
    """The checked ``resume_token_ids`` (router/resume.py) and the finish reason
    they already reach (None: none); many of them under stop strings are
    detokenized off the event loop."""
    check = functools.partial(
        resume_token_ids,
        request,
        prompt,
        params,
        vocab_size=backend.vocab_size,
        max_model_len=backend.max_model_len,
        eos_token_ids=backend.eos_token_ids,
        tokenizer=backend.tokenizer,
    )
    try:
        if params.stop and len(request.resume_token_ids) > _DETOKENIZE_IN_THREAD_TOKENS:
            return await asyncio.to_thread(check)
        return check()
    except ValueError as e:
        raise invalid_argument(str(e)) from None


def chunk_message(delta: TokenDelta) -> pb.GenerateResponse:
    chunk = pb.GenerateChunk(token_ids=delta.token_ids, text=delta.text)
    for lp in delta.logprobs or ():
        chunk.logprobs.append(
            pb.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_logprobs=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
        )
    return pb.GenerateResponse(chunk=chunk)


def final_message(request_id: str, result: GenerateResult) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        final=pb.GenerateFinal(
            request_id=request_id,
            finish_reason=result.finish_reason,
            usage=pb.Usage(
                prompt_tokens=result.prompt_tokens,
                cached_tokens=result.cached_tokens,
                completion_tokens=result.completion_tokens,
            ),
            timings=pb.Timings(
                ttft_s=result.ttft_s,
                mean_tpot_s=result.mean_tpot_s,
                prefill_worker=result.prefill_worker,
                decode_worker=result.decode_worker,
                predicted_cached_tokens=result.predicted_cached_tokens,
                realized_cached_tokens=result.cached_tokens,
            ),
        )
    )
