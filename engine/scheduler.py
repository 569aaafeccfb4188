"""Waiting and running queues, the per-step token budget, preemption.

Every sequence has ``num_computed`` tokens in the cache out of
``num_tokens`` known; a step gives each scheduled sequence up to the
remaining budget of new tokens. A decode is the case of one token, a
chunk of a long prompt the case of many, so chunked prefill and
continuous batching are the same loop:

1. Running sequences, oldest first, each get their tokens and the blocks
   to hold them. When blocks run out, cached blocks are evicted first
   (the pool does that), then the youngest running sequence is preempted:
   its holder's blocks are released and it goes back to the front of the
   queue, to be recomputed (its full blocks often survive in the prefix
   cache).
2. If nothing was preempted, waiting sequences are admitted in order,
   reusing the longest cached prefix, while budget and blocks last.

With the growth reserve on (``reserve_growth``, a decode worker's engine),
a sequence is admitted only if the blocks left after it cover what every
running sequence still needs to reach its longest possible length (its
max_tokens, within max_model_len) plus what ``external_reserve`` names
(pushes in flight): ``room()`` is what is left beyond that. Admissions then
never cause a preemption: every running sequence can grow to its end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_pool import BlockPool
from engine.hashing import BlockHash
from engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        root: BlockHash,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_prefix_caching: bool,
    ) -> None:
        self.pool = pool
        self.root = root
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.reserve_growth = False  # see the module docstring; enable_growth_reserve()
        self.max_model_len = 0
        self.external_reserve: Callable[[], int] = lambda: 0
        self.on_preempt: Callable[[Sequence], None] | None = None  # the worker's counters

    def enable_growth_reserve(self, max_model_len: int, external: Callable[[], int]) -> None:
        """Admit only what leaves every running sequence room to finish;
        ``external()``: blocks promised elsewhere (called under the pool's lock)."""
        self.reserve_growth = True
        self.max_model_len = max_model_len
        self.external_reserve = external

    def final_blocks(self, num_tokens: int, max_tokens: int, prefill_only: bool = False) -> int:
        """Blocks a request of ``num_tokens`` prompt tokens holds at its longest
        (the last token sampled is never computed), at most the whole pool."""
        longest = num_tokens if prefill_only else num_tokens + max_tokens - 1
        if self.max_model_len:
            longest = min(longest, self.max_model_len)
        return min(-(-longest // self.block_size), self.pool.num_blocks)

    def seq_final_blocks(self, seq: Sequence) -> int:
        return self.final_blocks(len(seq.prompt_token_ids), seq.params.max_tokens, seq.prefill_only)

    def growth_reserve(self) -> int:
        """Blocks the running sequences still need to reach their longest."""
        return sum(max(0, self.seq_final_blocks(s) - len(s.block_table)) for s in self.running)

    def room(self) -> int:
        """Blocks a new request may take without leaving a running sequence
        short (negative: the promises exceed what is free)."""
        return self.pool.num_free - self.growth_reserve() - self.external_reserve()

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks."""
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        self.free_blocks(seq)

    def free_blocks(self, seq: Sequence) -> None:
        """Release everything the sequence's holder holds and forget its progress."""
        if seq.block_table:
            self.pool.release(seq.holder)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
        seq.spec_token_ids = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed, budget)
            need = self._blocks_needed(seq, n)
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1])
                preempted = True
            if need > self.pool.num_free:
                self._preempt(seq)
                preempted = True
                break
            seq.block_table += self.pool.allocate(seq.holder, need)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.add_running(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        total = -(-(seq.num_computed + n) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Reuse the cached prefix and allocate blocks; 0 if it cannot start now."""
        matched: list[int] = []
        hashes: list[BlockHash] = []
        if self.enable_prefix_caching:
            tokens = seq.all_token_ids()
            bs = self.block_size
            usable = (len(tokens) - 1) // bs  # keep one token to compute: it gives the logits
            hashes = seq.full_block_hashes(usable, bs, self.root)
            chunks = [tokens[j * bs : (j + 1) * bs] for j in range(usable)]
            matched = self.pool.match_prefix(seq.holder, hashes, chunks, count_hits=False)
        seq.block_table = list(matched)
        seq.block_hashes = hashes[: len(matched)]
        seq.num_computed = len(matched) * self.block_size
        if self.reserve_growth and self.seq_final_blocks(seq) - len(matched) > self.room():
            self.free_blocks(seq)
            return 0
        n = min(seq.num_tokens - seq.num_computed, budget)
        blocks = self.pool.allocate(seq.holder, self._blocks_needed(seq, n))
        if blocks is None:
            self.free_blocks(seq)
            return 0
        seq.block_table += blocks
        self.pool.count_hits()  # admitted: its prefix hits count, once
        if not seq.output_token_ids:
            seq.num_cached_tokens = seq.num_computed
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_blocks(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq)
