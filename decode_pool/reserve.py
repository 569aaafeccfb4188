"""A decode worker's KV reserve: what new work may take without leaving a
running sequence short.

The engine's scheduler reserves, for every running sequence, the blocks it
still needs to reach its longest possible length (engine/scheduler.py,
``growth_reserve``). A push is one more claimant: from its header on, its
lease holder holds the blocks it received, and once it commits the request
grows to its own longest length. So a push's header is admitted only if
its blocks plus that growth fit in the room left after the running
sequences and the other pushes in flight; otherwise it waits
(kv_transfer/service.py). New requests on the scheduler's waiting queue
(``start_full``) see the pushes' growth as ``external_reserve``. Nothing
admitted then can make the scheduler preempt a running sequence.

``room()`` (free plus evictable cached blocks, less every promise) is what
the worker reports to the routers on its output streams.

Everything here runs under the engine loop's lock (the pool's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import Holder
from protocol.decode_start import DecodeStart

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sequence import Sequence


@dataclass
class _Expected:
    final_blocks: int  # its request's blocks at its longest
    forget_at: float  # when to forget it if it holds nothing (pushed back by each header try)
    holder: Holder | None = None  # its lease, from its header on


class PushReserve:
    def __init__(self, engine: LLMEngine, forget_after_s: float) -> None:
        """``forget_after_s``: how long an expected push that holds nothing is
        remembered (its lease, after which the transfer is gone anyway)."""
        self.pool = engine.block_pool
        self.scheduler = engine.scheduler
        self.forget_after_s = forget_after_s
        self._expected: dict[str, _Expected] = {}  # by request id
        self.num_push_preemptions = 0
        self.scheduler.enable_growth_reserve(engine.max_model_len, self.pending)
        self.scheduler.on_preempt = self._preempted

    def expect(self, request_id: str, start: DecodeStart) -> None:
        """A push for ``request_id`` passed its checks; its header comes next."""
        final = self.scheduler.final_blocks(start.num_prompt_tokens, start.params.max_tokens)
        self._expected[request_id] = _Expected(final, time.monotonic() + self.forget_after_s)

    def started(self, request_id: str) -> None:
        """The push's request joined the batch (the scheduler counts it now)."""
        self._expected.pop(request_id, None)

    def admit(self, holder: Holder, n: int) -> bool:
        """May ``holder`` (a push's lease, kv_transfer/lease.py) take ``n`` more blocks?"""
        entry = self._expected.get(_request_of(holder))
        held = len(self.pool.held_by(holder))
        growth = 0
        if entry is not None:
            entry.holder = holder
            # Its header asks again while it waits for room (up to its own
            # bound, transfer.lease_s from the header on): remembered as long.
            entry.forget_at = time.monotonic() + self.forget_after_s
            growth = max(0, entry.final_blocks - held - n)
        room = self.pool.num_free - self.scheduler.growth_reserve() - self.pending(holder)
        return n + growth <= room

    def pending(self, exclude: Holder | None = None) -> int:
        """Blocks the pushes in flight (but ``exclude``) still need to reach
        their requests' longest length."""
        now = time.monotonic()
        total = 0
        for rid, entry in list(self._expected.items()):
            held = len(self.pool.held_by(entry.holder)) if entry.holder is not None else 0
            if not held:
                if entry.forget_at < now:
                    del self._expected[rid]
                continue
            if entry.holder != exclude:
                total += max(0, entry.final_blocks - held)
        return total

    def room(self) -> int:
        return self.scheduler.room()

    def _preempted(self, seq: Sequence) -> None:
        holders = [e.holder for e in self._expected.values() if e.holder is not None]
        if any(self.pool.held_by(h) for h in holders):
            self.num_push_preemptions += 1


def _request_of(holder: Holder) -> str:
    """The request id in a receiving lease's holder id ("recv:<id>#<n>")."""
    role, _, rest = holder.id.partition(":")
    return rest.rpartition("#")[0] if role == "recv" else ""
