"""One worker's engine as the model runs it: the scheduler's step loop.

A step gives every running sequence its tokens, oldest first, out of a
token budget (``max_num_batched_tokens``): a decoding sequence one, a
prompt the rest of its prompt or what the budget leaves (chunked
prefill); then waiting sequences start in order while budget is left,
skipping the leading blocks the worker's prefix cache holds. The step
takes the profile's time for what it computes (``StepCost``). A budget of
0 means one whole prompt a step, no chunking (for closed-form checks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from planner.blocks import PrefixCache, block_keys, blocks_for

PrefillCost = Callable[[Sequence[int]], float]
DecodeCost = Callable[[int, float], float]


StepFn = Callable[[Sequence[int], Sequence[int], int, float], float]


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step: prompt chunks (their lengths and the
    tokens cached before each) and a decode batch (its mean context).
    ``step``: the profile's own rule for a step (planner/profile.py
    ``Profile.step_s``, what the simulated engine waits); without it a mixed
    step costs both parts."""

    prefill: PrefillCost
    decode: DecodeCost
    step: StepFn | None = None

    def step_s(
        self, chunks: Sequence[int], contexts: Sequence[int], batch: int, mean_ctx: float
    ) -> float:
        if self.step is not None:
            return self.step(chunks, contexts, batch, mean_ctx)
        t = self.prefill(chunks) if chunks else 0.0
        if batch:
            t += self.decode(batch, mean_ctx)
        return t


@dataclass(eq=False)
class Seq:
    """A request on the model's path, with the times the result reports."""

    id: int
    arrival: float
    prompt: tuple[int, ...]
    output_len: int
    block_size: int
    keys: list[int] = field(init=False)
    computed: int = 0
    generated: int = 0
    cached_tokens: int = 0  # prompt tokens a cache served (prefill side)
    admitted: float = -1.0  # routed: room found on a decode worker
    prefill_start: float = -1.0
    prefill_end: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    pushed_blocks: int = 0
    local: bool = False  # prefilled on its decode worker
    failed: bool = False  # refused: longer than a decode worker's whole pool

    def __post_init__(self) -> None:
        self.keys = block_keys(self.prompt, self.block_size)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def final_blocks(self) -> int:
        return blocks_for(self.prompt_len + self.output_len, self.block_size)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def queue_wait(self) -> float:
        return self.prefill_start - self.arrival

    @property
    def tpot(self) -> float:
        if self.output_len <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.output_len - 1)

    @property
    def usable_keys(self) -> list[int]:
        """Leading blocks a cache may serve: one token is always computed."""
        return self.keys[: (self.prompt_len - 1) // self.block_size]


class WorkerModel:
    """A prefill or decode worker: its engine's queues, prefix cache and load."""

    def __init__(self, name: str, total_blocks: int, budget: int, max_seqs: int) -> None:
        self.name = name
        self.cache = PrefixCache(total_blocks)
        self.budget = budget
        self.max_seqs = max_seqs
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.joining: list[Seq] = []  # pushed in during a step: first token at its end
        self.busy = False
        self.kick_pending = False  # a step start is due at this instant
        self.step_end = 0.0
        self.in_flight = 0  # the router's count, as WorkerHandle.in_flight
        self.reserved = 0  # decode: blocks promised to admitted requests

    def room(self) -> int:
        return self.cache.total_blocks - self.reserved

    def plan_step(self, now: float) -> tuple[list[tuple[Seq, int]], list[Seq]]:
        """What the next step computes: (prompt chunks, decoding sequences).
        Starts waiting sequences (their prefix hits are taken here)."""
        unlimited = self.budget == 0
        budget = self.budget
        chunks: list[tuple[Seq, int]] = []
        decodes: list[Seq] = []
        for s in self.running:
            if not unlimited and budget <= 0:
                break
            if s.computed >= s.prompt_len:
                decodes.append(s)
                budget -= 1
            else:
                n = self._chunk(s, budget)
                chunks.append((s, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_seqs:
            if (unlimited and chunks) or (not unlimited and budget <= 0):
                break
            s = self.waiting.popleft()
            self._start(s, now)
            n = self._chunk(s, budget)
            chunks.append((s, n))
            budget -= n
        return chunks, decodes

    def _chunk(self, s: Seq, budget: int) -> int:
        left = s.prompt_len - s.computed
        return left if self.budget == 0 else min(left, budget)

    def _start(self, s: Seq, now: float) -> None:
        hit = self.cache.leading(s.usable_keys)
        self.cache.touch(s.keys[:hit])
        s.computed = hit * s.block_size
        s.cached_tokens = s.computed
        s.prefill_start = now
        self.running.append(s)
