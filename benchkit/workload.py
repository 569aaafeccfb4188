"""What to send and when: arrival times and prompts.

A workload is a stream of :class:`Conversation` s. A single-turn workload
has one turn per conversation; with ``turns=K`` turn ``k``'s prompt is the
previous turn's prompt, its answer, and a new user message (built by
:func:`next_turn_prompt` once the answer is known).

Synthetic prompts are random token ids within the served model's
vocabulary (:class:`TokenRange`: ``[10, vocab_size)``, the lowest ids
being where tokenizers keep their special tokens); everything is drawn
from a seeded numpy generator, so a seed and a vocabulary give the same
workload. Arrival gaps come from a separate stream, so the prompts do not
depend on the rate. :func:`synthetic_fit_problem` and
:func:`dataset_fit_problem` check a workload against the served model's
limits before anything is sent.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from router.model_info import ModelInfo

SKIPPED_LOW_IDS = 10
"""Synthetic prompts leave out ids below this (special tokens: BOS, EOS, pad, ...)
when the vocabulary has at least twice as many ids."""

Prompt = str | list[int]


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))


def parse_length(text: str) -> LengthRange:
    """``"256"`` (fixed) or ``"64:512"`` (uniform, both ends included)."""
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ValueError(f"expected N or LOW:HIGH, got {text!r}") from None
    if low < 1 or high < low:
        raise ValueError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return LengthRange(low, high)


@dataclass(frozen=True)
class TokenRange:
    """The token ids synthetic prompts are drawn from: ``[low, high)``."""

    low: int
    high: int  # exclusive

    @classmethod
    def for_vocab(cls, vocab_size: int) -> TokenRange:
        """Ids of a vocabulary of ``vocab_size`` tokens, never beyond it."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        return cls(SKIPPED_LOW_IDS if vocab_size >= 2 * SKIPPED_LOW_IDS else 0, vocab_size)


@dataclass
class Turn:
    message: Prompt  # the new user message (the whole prompt for turn 0)
    max_tokens: int


@dataclass
class Conversation:
    index: int
    turns: list[Turn]


# ---------------------------------------------------------------- arrivals


def interarrival_gaps(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Endless gaps (s) between arrivals with mean ``1/rate``.

    Gamma distributed with shape ``burstiness`` (1: exponential, i.e.
    Poisson arrivals; below 1 burstier, above 1 more regular); an infinite
    rate gives zero gaps (everything at once).
    """
    if burstiness <= 0:
        raise ValueError("burstiness must be positive")
    if rate <= 0:
        raise ValueError("rate must be positive")
    if math.isinf(rate):
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng([seed, 1])
    theta = 1.0 / (rate * burstiness)
    while True:
        yield from rng.gamma(burstiness, theta, size=256).tolist()


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The first ``n`` arrival times (s from the start); the first is 0."""
    gaps = interarrival_gaps(rate, burstiness, seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += next(gaps)
    return out


# ---------------------------------------------------------------- prompts


def random_tokens(rng: np.random.Generator, n: int, tokens: TokenRange) -> list[int]:
    return rng.integers(tokens.low, tokens.high, size=n).tolist()


def synthetic_conversations(
    input_len: LengthRange,
    output_len: LengthRange,
    *,
    vocab_size: int,
    seed: int = 0,
    shared_prefix_ratio: float = 0.0,
    turns: int = 1,
) -> Iterator[Conversation]:
    """Endless random-token conversations, token ids within ``vocab_size``
    (the served model's: :class:`TokenRange`).

    With ``shared_prefix_ratio`` r, the first ``round(r * L)`` tokens of
    each first-turn prompt of length L come from one prefix shared by all
    conversations (so with a fixed input length every request starts with
    the same prefix). Later turns' messages are fresh random tokens.
    """
    if not 0.0 <= shared_prefix_ratio <= 1.0:
        raise ValueError("shared_prefix_ratio must be in [0, 1]")
    if turns < 1:
        raise ValueError("turns must be >= 1")
    tokens = TokenRange.for_vocab(vocab_size)
    rng = np.random.default_rng([seed, 0])
    prefix = random_tokens(rng, round(shared_prefix_ratio * input_len.high), tokens)
    for index in itertools.count():
        conv_turns = []
        for k in range(turns):
            length = input_len.sample(rng)
            shared = round(shared_prefix_ratio * length) if k == 0 else 0
            message = prefix[:shared] + random_tokens(rng, length - shared, tokens)
            conv_turns.append(Turn(message, output_len.sample(rng)))
        yield Conversation(index, conv_turns)


def load_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL dataset: ``{"prompt": str}`` or ``{"prompt_token_ids": [int]}``,
    optionally ``"max_tokens"``. Blank lines are skipped; bad rows raise
    ValueError naming the line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            if isinstance(row.get("prompt_token_ids"), list) and all(
                isinstance(t, int) for t in row["prompt_token_ids"]
            ):
                prompt: Prompt = list(row["prompt_token_ids"])
            elif isinstance(row.get("prompt"), str):
                prompt = row["prompt"]
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' (str) or 'prompt_token_ids'")
            if not prompt:
                raise ValueError(f"{path}:{lineno}: empty prompt")
            max_tokens = row.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"{path}:{lineno}: max_tokens must be a positive int")
            rows.append({"prompt": prompt, "max_tokens": max_tokens})
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def dataset_conversations(
    rows: Sequence[dict], output_len: LengthRange, *, seed: int = 0, turns: int = 1
) -> Iterator[Conversation]:
    """Endless conversations from dataset rows, in order, wrapping around;
    a conversation of K turns takes K consecutive rows. A row without
    ``max_tokens`` gets one drawn from ``output_len``."""
    if turns > 1 and len({type(r["prompt"]) for r in rows}) > 1:
        raise ValueError("multi-turn needs all dataset prompts as text or all as token ids")
    rng = np.random.default_rng([seed, 0])
    source = itertools.cycle(rows)
    for index in itertools.count():
        conv_turns = []
        for _ in range(turns):
            row = next(source)
            max_tokens = row["max_tokens"] or output_len.sample(rng)
            conv_turns.append(Turn(row["prompt"], max_tokens))
        yield Conversation(index, conv_turns)


# ---------------------------------------------------------------- limits


def synthetic_fit_problem(
    input_len: LengthRange, output_len: LengthRange, turns: int, max_model_len: int
) -> str | None:
    """Why a synthetic workload may not fit the served context, else None.

    A request's prompt plus its max_tokens must fit in ``max_model_len``
    (else the prompt is refused or the answer cut short). Turn k's prompt
    holds every earlier message and answer, so the longest request of K
    turns needs K x (longest input + longest output). 0: unknown, no check.
    """
    need = turns * (input_len.high + output_len.high)
    if not max_model_len or need <= max_model_len:
        return None
    if turns == 1:
        why = f"a prompt of {input_len.high} tokens plus max_tokens {output_len.high}"
    else:
        why = (
            f"the last of {turns} turns holds {turns} messages of up to {input_len.high} "
            f"tokens and the answers, plus max_tokens up to {output_len.high}"
        )
    knobs = "--input-len, --output-len" + (" or --turns" if turns > 1 else "")
    return (
        f"the workload needs up to {need} tokens per request ({why}), more than the "
        f"served model's max_model_len of {max_model_len}: lower {knobs}"
    )


def dataset_fit_problem(
    rows: Sequence[dict], output_len: LengthRange, turns: int, model: ModelInfo
) -> str | None:
    """Why dataset rows cannot be served as they are, else None: a text prompt
    to a server without a tokenizer, a token id outside the vocabulary, or (one
    turn) a token-id prompt plus its max_tokens beyond max_model_len."""
    for number, row in enumerate(rows, 1):
        max_tokens = row["max_tokens"] or output_len.high
        problem = _row_problem(row["prompt"], max_tokens, turns, model)
        if problem is not None:
            return f"dataset row {number}: {problem}"
    return None


def _row_problem(prompt: Prompt, max_tokens: int, turns: int, model: ModelInfo) -> str | None:
    if isinstance(prompt, str):
        if model.has_tokenizer:
            return None
        return "a text prompt, but the server has no tokenizer (give prompt_token_ids)"
    vocab = model.vocab_size
    bad = next((t for t in prompt if vocab and not 0 <= t < vocab), None)
    if bad is not None:
        return f"token id {bad} is outside the served vocabulary [0, {vocab})"
    limit = model.max_model_len
    if turns == 1 and limit and len(prompt) + max_tokens > limit:
        return (
            f"{len(prompt)} prompt tokens plus max_tokens {max_tokens} exceed the "
            f"served model's max_model_len of {limit}"
        )
    return None


def next_turn_prompt(previous_prompt: Prompt, answer: Prompt, message: Prompt) -> Prompt:
    """Turn k's prompt: turn k-1's prompt + its answer + the new message.

    Token-id prompts are extended with the answer's token ids; text prompts
    with the answer's text.
    """
    if isinstance(previous_prompt, str):
        if not isinstance(answer, str) or not isinstance(message, str):
            raise TypeError("a text conversation needs text answers and messages")
        return previous_prompt + answer + message
    if isinstance(answer, str) or isinstance(message, str):
        raise TypeError("a token-id conversation needs token-id answers and messages")
    return [*previous_prompt, *answer, *message]


def conversation_prompts(conv: Conversation, answers: Sequence[Prompt]) -> list[Prompt]:
    """Every turn's prompt, given the answers to all turns but the last
    (for tests and offline inspection; the runner builds them one by one)."""
    prompts = [conv.turns[0].message]
    for turn, answer in zip(conv.turns[1:], answers, strict=False):
        prompts.append(next_turn_prompt(prompts[-1], answer, turn.message))
    return prompts
