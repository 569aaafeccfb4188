"""Returning conversations: the workload the second KV tier is for (its
tests and bench/kv_tier.py).

``conversations`` chats of ``turns`` turns, played round-robin (every
chat's turn 1, then every chat's turn 2, ...), one request at a time, so
that between two turns of one chat the others' turns pass through the
pool. Turn k's prompt is turn k-1's prompt, its greedy output and new user
tokens: its prefix is the last turn's whole context.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from protocol.sampling import SamplingParams


@dataclass(frozen=True)
class Workload:
    conversations: int = 12
    turns: int = 3
    first_tokens: int = 40
    user_tokens: int = 20
    output_tokens: int = 8
    seed: int = 0
    vocab: tuple[int, int] = (10, 5000)

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=self.output_tokens, ignore_eos=True)

    def longest_request(self) -> int:
        """Tokens of the last turn's prompt plus its output."""
        t = self.turns
        return (
            self.first_tokens
            + (t - 1) * (self.output_tokens + self.user_tokens)
            + (self.output_tokens)
        )


@dataclass
class Turn:
    """One request's result."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output: list[int]
    ttft_s: float


@dataclass
class Played:
    turns: list[Turn] = field(default_factory=list)

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        return {(t.conversation, t.turn): t.output for t in self.turns}

    def cached(self) -> dict[tuple[int, int], int]:
        return {(t.conversation, t.turn): t.cached_tokens for t in self.turns}

    def cached_tokens(self, returning_only: bool = False) -> int:
        return sum(t.cached_tokens for t in self.turns if t.turn > 0 or not returning_only)

    def returning_ttft_s(self) -> list[float]:
        return [t.ttft_s for t in self.turns if t.turn > 0]


def play(engine: LLMEngine, workload: Workload) -> Played:
    """Run the workload to its end on ``engine``, one request at a time."""
    rng = random.Random(workload.seed)
    lo, hi = workload.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    contexts = [tokens(workload.first_tokens) for _ in range(workload.conversations)]
    played = Played()
    for turn in range(workload.turns):
        for c in range(workload.conversations):
            if turn:
                contexts[c] = contexts[c] + tokens(workload.user_tokens)
            result = _one(engine, f"c{c}t{turn}", contexts[c], workload.params())
            played.turns.append(Turn(c, turn, len(contexts[c]), *result))
            contexts[c] = contexts[c] + result[1]
    return played


def _one(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> tuple[int, list[int], float]:
    """(cached prompt tokens, output tokens, seconds to the first token)."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    output: list[int] = []
    cached, ttft = 0, 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if not output:
                ttft = time.perf_counter() - start
            output += out.new_token_ids
            cached = out.num_cached_tokens
    return cached, output, ttft
