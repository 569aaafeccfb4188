"""A client's resume: a request sent again, with the tokens it already received
(``resume_token_ids``), after the router that streamed them was lost.

The router checks them like prompt tokens, then generates after them as the
in-router failover does after a lost decode worker (router/failover.py): they
count as output tokens (max_tokens, min_tokens, penalties, the seeded draw of
each position, the detokenizer and stop strings), so the stream continues as
the uninterrupted one would have. Tokens that already end the request (EOS,
a stop token, a stop string, max_tokens or max_model_len reached by the last
of them) end it at once with that finish reason; tokens the request could
never have streamed (any after such an end) are refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any

from protocol.sampling import SamplingParams
from protos.tandem.v1 import generate_pb2 as pb

from .backend import GenerateInput, GenerateResult, TokenDelta

FIELD = "resume_token_ids"


def resume_token_ids(
    request: pb.GenerateRequest,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: Collection[int] = (),
    tokenizer: Any = None,
) -> tuple[list[int], str | None]:
    """The request's resumed tokens and the finish reason they already reach
    (None: generation goes on after them). Raises ValueError naming the
    field (the caller answers INVALID_ARGUMENT)."""
    ids = list(request.resume_token_ids)
    if not ids:
        return [], None
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{FIELD}[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > params.max_tokens:
        raise ValueError(
            f"{FIELD} has {len(ids)} tokens, more than max_tokens ({params.max_tokens})"
        )
    if len(prompt) + len(ids) > max_model_len:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) and {FIELD} ({len(ids)}) exceed "
            f"max_model_len ({max_model_len})"
        )
    ends = _ends(prompt, ids, params, max_model_len, eos_token_ids, tokenizer)
    for i, reason in enumerate(ends):
        if reason is not None and i < len(ids) - 1:
            raise ValueError(
                f"{FIELD}[{i}] already ends the request ({reason}): "
                f"no token can follow it, yet {len(ids) - 1 - i} do"
            )
    return ids, ends[-1]


def _ends(
    prompt: Sequence[int],
    ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    eos_token_ids: Collection[int],
    tokenizer: Any,
) -> list[str | None]:
    """For each resumed token, the finish reason the engine would have given
    when it sampled it (engine/llm_engine.py ``_append_token``), else None."""
    stopped = _stop_string_hits(prompt, ids, params, tokenizer)
    ends: list[str | None] = []
    for i, token in enumerate(ids):
        n_out = i + 1
        if stopped[i] or (
            n_out >= params.min_tokens
            and (
                token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos)
            )
        ):
            ends.append("stop")
        elif n_out >= params.max_tokens or len(prompt) + n_out >= max_model_len:
            ends.append("length")
        else:
            ends.append(None)
    return ends


def _stop_string_hits(
    prompt: Sequence[int], ids: list[int], params: SamplingParams, tokenizer: Any
) -> list[bool]:
    """Whether each resumed token completed a stop string, by the engine's own
    detokenizer (same prompt context, same special-token handling)."""
    if not params.stop or tokenizer is None:
        return [False] * len(ids)
    from engine.detokenizer import IncrementalDetokenizer  # torch-free

    detok = IncrementalDetokenizer(tokenizer, prompt, params.stop, params.skip_special_tokens)
    return [detok.add(t).stopped for t in ids]


async def finished_at_once(inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
    """The stream of a resumed request its tokens already ended: no delta, the
    result, with every resumed token counted as a completion token."""
    assert inp.resumed_finish is not None
    yield GenerateResult(
        finish_reason=inp.resumed_finish,
        prompt_tokens=len(inp.prompt_token_ids),
        cached_tokens=0,
        completion_tokens=len(inp.resume_token_ids),
        ttft_s=0.0,
        mean_tpot_s=0.0,
        prefill_worker="",
        decode_worker="",
    )
