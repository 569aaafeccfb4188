"""Traces: the exact requests a simulation and a replay both run.

A trace is a list of requests, each with its arrival time (seconds from the
start), its prompt's token ids and its output length (``max_tokens``, with
EOS ignored). The same trace, seeded, drives the planner's model
(``planner.simulator``) and the replay against a deployment
(``planner.verify``), so predicted and measured latencies describe the same
load.

Three workloads (``WORKLOADS``):

- ``chat``: short prompts (64-512 tokens), short answers, Poisson arrivals.
- ``long``: RAG-like prompts of 2-8k tokens, short answers.
- ``multiturn``: conversations of a few turns; every prompt starts with one
  system prompt shared by all conversations, and turn k+1's prompt is turn
  k's prompt, an answer and a new user message, so it shares turn k's prompt
  as a prefix. The answer in the next prompt is the trace's own (the
  engine's real answer is not known before the run), so prefix reuse comes
  from the prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_VERSION = 1


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]

    def __post_init__(self) -> None:
        times = [r.arrival_s for r in self.requests]
        if times != sorted(times):
            raise ValueError("trace requests must be in arrival order")
        if any(r.prompt_len < 1 or r.output_len < 1 for r in self.requests):
            raise ValueError("every request needs a prompt and an output of at least 1 token")

    def save(self, path: str | Path) -> None:
        data = {
            "version": TRACE_VERSION,
            "name": self.name,
            "requests": [
                {"arrival_s": r.arrival_s, "prompt": list(r.prompt), "output_len": r.output_len}
                for r in self.requests
            ],
        }
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = json.loads(Path(path).read_text())
        if data.get("version") != TRACE_VERSION:
            raise ValueError(f"trace version {data.get('version')!r}, expected {TRACE_VERSION}")
        reqs = tuple(
            TraceRequest(float(r["arrival_s"]), tuple(r["prompt"]), int(r["output_len"]))
            for r in data["requests"]
        )
        return cls(str(data["name"]), reqs)

    def stats(self) -> WorkloadStats:
        return WorkloadStats.of(self)


@dataclass(frozen=True)
class WorkloadStats:
    """What the model needs to know of a load, without its tokens: arrival
    rate, the lengths, and the share of prompt tokens a cache could serve
    (``prefix_share``: tokens in leading full blocks an earlier prompt of the
    trace had, over all prompt tokens)."""

    rate: float
    prompt_lens: tuple[int, int]  # (p10, p90)
    output_lens: tuple[int, int]
    mean_prompt_len: float
    mean_output_len: float
    prefix_share: float

    @classmethod
    def of(cls, trace: Trace, block_size: int = 16) -> WorkloadStats:
        reqs = trace.requests
        span = reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0
        rate = (len(reqs) - 1) / span if span > 0 else float(len(reqs))
        p = np.array([r.prompt_len for r in reqs])
        o = np.array([r.output_len for r in reqs])
        seen: set[tuple[int, ...]] = set()
        shared = 0
        for r in reqs:
            usable = (r.prompt_len - 1) // block_size
            hit = True
            for j in range(usable):
                key = r.prompt[: (j + 1) * block_size]
                if hit and key in seen:
                    shared += block_size
                else:
                    hit = False
                    seen.add(key)
        return cls(
            rate=rate,
            prompt_lens=(int(np.percentile(p, 10)), int(np.percentile(p, 90))),
            output_lens=(int(np.percentile(o, 10)), int(np.percentile(o, 90))),
            mean_prompt_len=float(p.mean()),
            mean_output_len=float(o.mean()),
            prefix_share=shared / float(p.sum()),
        )


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.choices(range(1, vocab), k=n))


def _arrivals(rng: random.Random, rate: float, n: int, cv: float = 1.0) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        if cv == 1.0:
            t += rng.expovariate(rate)
        else:
            shape = 1.0 / cv**2
            t += rng.gammavariate(shape, 1.0 / (shape * rate))
        out.append(t)
    return out


def independent(
    name: str,
    *,
    rate: float,
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab: int,
    seed: int,
    cv: float = 1.0,
) -> Trace:
    """Requests with prompts of their own (uniform lengths), Poisson (cv 1) or
    gamma arrivals."""
    rng = random.Random(seed)
    reqs = tuple(
        TraceRequest(t, _tokens(rng, rng.randint(*input_len), vocab), rng.randint(*output_len))
        for t in _arrivals(rng, rate, num_requests, cv)
    )
    return Trace(name, reqs)


def chat(rate: float, num_requests: int, vocab: int, seed: int = 0) -> Trace:
    return independent(
        "chat", rate=rate, num_requests=num_requests, input_len=(64, 512),
        output_len=(32, 128), vocab=vocab, seed=seed,
    )  # fmt: skip


def long_prompts(rate: float, num_requests: int, vocab: int, seed: int = 0) -> Trace:
    return independent(
        "long", rate=rate, num_requests=num_requests, input_len=(2048, 8192),
        output_len=(32, 128), vocab=vocab, seed=seed,
    )  # fmt: skip


def multi_turn(
    rate: float,
    num_requests: int,
    vocab: int,
    seed: int = 0,
    *,
    system_len: int = 256,
    turns: tuple[int, int] = (2, 5),
    user_len: tuple[int, int] = (32, 160),
    output_len: tuple[int, int] = (32, 128),
    think_s: float = 3.0,
) -> Trace:
    """Conversations start at ``rate / mean turns`` a second (so requests
    arrive at about ``rate``); the next turn follows an exponential think
    time after the previous one's arrival plus its expected length."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len, vocab)
    mean_turns = (turns[0] + turns[1]) / 2
    reqs: list[TraceRequest] = []
    starts = _arrivals(rng, rate / mean_turns, max(1, round(num_requests / mean_turns)))
    for start in starts:
        t, context = start, system
        for _ in range(rng.randint(*turns)):
            prompt = context + _tokens(rng, rng.randint(*user_len), vocab)
            out = rng.randint(*output_len)
            reqs.append(TraceRequest(t, prompt, out))
            context = prompt + _tokens(rng, out, vocab)
            t += rng.expovariate(1.0 / think_s)
    reqs.sort(key=lambda r: r.arrival_s)
    return Trace("multiturn", tuple(reqs[:num_requests]))


WORKLOADS: dict[str, Callable[..., Trace]] = {
    "chat": chat,
    "long": long_prompts,
    "multiturn": multi_turn,
}
