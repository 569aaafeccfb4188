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

The scheduler asks for ``pending()`` every step, so it is a running count,
kept as the pushes' leases change (``held``: the block store tells it when
a receiving lease's blocks change, at its header, its release on a failure
or expiry; ``settled``: the commit hands them to the request).

Everything here runs under the engine loop's lock (the pool's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import Holder
from kv_transfer.lease import LeaseHolder
from protocol.decode_start import DecodeStart

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sequence import Sequence


@dataclass
class _Expected:
    final_blocks: int  # its request's blocks at its longest
    forget_at: float  # when to forget it if it holds nothing (pushed back by each header try)
    holder: Holder | None = None  # its lease, from its header on
    held: int = 0  # the blocks its lease holds

    @property
    def growth(self) -> int:
        """What it still needs to reach its longest: nothing once it holds nothing."""
        return max(0, self.final_blocks - self.held) if self.held else 0


class PushReserve:
    def __init__(self, engine: LLMEngine, forget_after_s: float) -> None:
        """``forget_after_s``: how long an expected push that holds nothing is
        remembered (its lease, after which the transfer is gone anyway)."""
        self.pool = engine.block_pool
        self.scheduler = engine.scheduler
        self.forget_after_s = forget_after_s
        self._expected: dict[str, _Expected] = {}  # by request id
        self._pending = 0  # the sum of their growths
        self.num_push_preemptions = 0
        self.scheduler.enable_growth_reserve(engine.max_model_len, self.pending)
        self.scheduler.on_preempt = self._preempted

    def expect(self, request_id: str, start: DecodeStart) -> None:
        """A push for ``request_id`` passed its checks; its header comes next."""
        self._forget_idle()
        self._drop(request_id)
        final = self.scheduler.final_blocks(start.num_prompt_tokens, start.params.max_tokens)
        self._expected[request_id] = _Expected(final, time.monotonic() + self.forget_after_s)

    def settled(self, request_id: str) -> None:
        """The push's request joined the batch (the scheduler counts it from
        here), or was dropped: its lease's blocks are no longer the push's."""
        self._drop(request_id)

    def admit(self, holder: Holder, n: int) -> bool:
        """May ``holder`` (a push's lease, kv_transfer/lease.py) take ``n`` more blocks?"""
        self._forget_idle()
        entry = self._entry(holder)
        growth = own = 0
        if entry is not None:
            self._track(entry, holder)
            # Its header asks again while it waits for room (up to its own
            # bound, transfer.lease_s from the header on): remembered as long.
            entry.forget_at = time.monotonic() + self.forget_after_s
            growth = max(0, entry.final_blocks - entry.held - n)
            own = entry.growth
        room = self.pool.num_free - self.scheduler.growth_reserve() - (self._pending - own)
        return n + growth <= room

    def held(self, holder: Holder) -> None:
        """What ``holder`` holds changed (a reserve, a prefix held, a release;
        the block store calls this under the pool's lock)."""
        entry = self._entry(holder)
        if entry is None:
            return
        if holder != entry.holder and not self.pool.held_by(holder):
            return  # an earlier transfer for the request let its blocks go
        self._track(entry, holder)

    def num_expected(self) -> int:
        """Pushes expected (not past their time) or holding blocks, whose
        requests have not joined the batch yet."""
        now = time.monotonic()
        return sum(1 for e in list(self._expected.values()) if e.held or e.forget_at >= now)

    def pending(self) -> int:
        """Blocks the pushes in flight still need to reach their requests'
        longest length."""
        return self._pending

    def room(self) -> int:
        return self.scheduler.room()

    def _entry(self, holder: Holder) -> _Expected | None:
        if not isinstance(holder, LeaseHolder) or holder.role != "recv":
            return None
        return self._expected.get(holder.request_id)

    def _track(self, entry: _Expected, holder: Holder) -> None:
        """``entry`` is ``holder``'s (the latest transfer for its request), with
        what it holds now."""
        self._pending -= entry.growth
        entry.holder = holder
        entry.held = len(self.pool.held_by(holder))
        self._pending += entry.growth

    def _drop(self, request_id: str) -> None:
        entry = self._expected.pop(request_id, None)
        if entry is not None:
            self._pending -= entry.growth

    def _forget_idle(self) -> None:
        """Forget the pushes that hold nothing past their time (their
        transfers are gone)."""
        now = time.monotonic()
        for rid in [r for r, e in self._expected.items() if not e.held and e.forget_at < now]:
            del self._expected[rid]

    def _preempted(self, seq: Sequence) -> None:
        if any(e.held for e in self._expected.values()):
            self.num_push_preemptions += 1
