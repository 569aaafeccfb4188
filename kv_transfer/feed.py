"""The blocks of one outgoing push, as their KV becomes ready.

A prefill worker pushes a request's KV while the prompt is still being
computed: the engine reports from its own thread which layers hold the KV
of how many leading tokens (``progress``), and the push sends each (layer,
block) once all its tokens are in (``take``). ``finish`` brings the token
the prefill sampled, which the commit carries. A push whose blocks are all
ready from the start (``KVFeed.ready``: a whole prompt pushed after its
prefill, a pull) is the same thing with a single report.

Every block a report names is pinned at once by the feed's lease holder,
on the engine thread, before the step that computed it ends: between steps
the request may be preempted or aborted and its blocks reused. ``close``
releases them all, exactly once, whatever became of the push.

Thread-safe: every method runs under ``lock``, which a prefill worker
shares with its engine loop (the block pool's lock), so a report made
during a step's bookkeeping takes no other lock first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from engine.block_pool import Holder

from .interface import BlockSource, TransferError
from .lease import lease_holder

# (layer_start, layer_end, block_start, block_end), blocks numbered as in the header
Span = tuple[int, int, int, int]


@dataclass(frozen=True)
class Final:
    """What the commit carries: tokens sampled after the pushed ones (their KV
    is not in the blocks) and the first token's details (protocol/decode_start.py)."""

    next_token_ids: tuple[int, ...] = ()
    first_token: bytes = b""


class KVFeed:
    def __init__(
        self,
        source: BlockSource,
        lock: threading.RLock,
        holder: Holder,
        num_tokens: int,
        computed: bool = False,
    ) -> None:
        """A feed of the KV of ``num_tokens`` leading tokens, none ready yet;
        ``holder`` pins what is reported. ``computed``: a report comes only once
        the KV is in device memory (an engine's layer reports), so reading a
        reported block need not wait for the engine's queued work."""
        layout = source.layout
        self.source, self.lock, self.holder = source, lock, holder
        self.block_size = layout.block_size
        self.num_tokens = num_tokens
        self.computed = computed
        self.num_blocks = -(-num_tokens // layout.block_size)
        self.block_ids: list[int | None] = [None] * self.num_blocks  # pinned, by position
        self._tokens = [0] * layout.num_layers  # per layer: leading tokens whose KV is in
        self._sent = [0] * layout.num_layers  # per layer: leading blocks taken
        self.final: Final | None = None
        self.error: TransferError | None = None
        self.started = False  # a report came: the push may open
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @classmethod
    def for_request(
        cls, source: BlockSource, lock: threading.RLock, request_id: str, num_tokens: int
    ) -> KVFeed:
        """The feed of a prefill's KV, reported by its engine as computed."""
        return cls(source, lock, lease_holder("send", request_id), num_tokens, computed=True)

    @classmethod
    def ready(
        cls,
        source: BlockSource,
        lock: threading.RLock,
        holder: Holder,
        block_ids: Sequence[int],
        final: Final | None = Final(),
        pinned: bool = False,
    ) -> KVFeed:
        """Every block ready at once (``pinned``: ``holder`` pins them already)."""
        feed = cls(source, lock, holder, len(block_ids) * source.layout.block_size)
        with lock:
            if pinned:
                feed.block_ids = list(block_ids)
            feed._complete(block_ids)
            feed.final = final
        return feed

    # ---- the producer (the engine thread, or whoever has the blocks) ----

    def progress(
        self, block_ids: Sequence[int], computed_before: int, computed: int, layers: int
    ) -> None:
        """Layers [0, ``layers``) hold the KV of the first ``computed`` tokens,
        the others of the first ``computed_before``; ``block_ids``: the request's
        blocks in order, held by it for now."""
        with self.lock:
            if self._closed or self.final is not None or self.error is not None:
                return  # nothing more to send: pin nothing more
            for layer in range(len(self._tokens)):
                done = computed if layer < layers else computed_before
                self._tokens[layer] = max(self._tokens[layer], min(done, self.num_tokens))
            self._pin(block_ids, self._ready_blocks(max(self._tokens)))
            self.started = True
            self._wake()

    def finish(self, block_ids: Sequence[int] | None, final: Final) -> None:
        """The prefill is done: every block is ready (``block_ids``: the
        request's, held by it for now; None: all were reported already, or, if
        none was and no push opened yet, the push carries no block)."""
        with self.lock:
            if self._closed:
                return
            if block_ids is None and not self.started and all(b is None for b in self.block_ids):
                self.num_tokens, self.num_blocks, self.block_ids = 0, 0, []
            elif block_ids is None and None in self.block_ids:
                self._fail(TransferError(grpc.StatusCode.INTERNAL, "KV not all computed"))
                return
            self._complete(block_ids or [])
            self.final = final
            self._wake()

    def fail(self, error: TransferError) -> None:
        """The push cannot go on (its request ended otherwise)."""
        with self.lock:
            self._fail(error)

    def close(self) -> None:
        """Release every pinned block; safe to call more than once."""
        with self.lock:
            if not self._closed:
                self._closed = True
                self.source.release(self.holder, [b for b in self.block_ids if b is not None])
                self._fail(TransferError(grpc.StatusCode.CANCELLED, "the push was closed"))

    # ---- the consumer (the push, on its event loop) ----

    def skip(self, held: int) -> None:
        """The receiver holds the first ``held`` blocks: never take them."""
        with self.lock:
            self._sent = [max(s, held) for s in self._sent]

    def take(self) -> tuple[list[Span], Final | None]:
        """The spans ready since the last take (one per run of layers with the
        same new blocks), and the final once every span was taken; raises the
        feed's error."""
        with self.lock:
            if self.error is not None:
                raise self.error
            spans: list[Span] = []
            for layer, tokens in enumerate(self._tokens):
                lo, hi = self._sent[layer], self._ready_blocks(tokens)
                if lo >= hi:
                    continue
                self._sent[layer] = hi
                if spans and spans[-1][1] == layer and spans[-1][2:] == (lo, hi):
                    spans[-1] = (spans[-1][0], layer + 1, lo, hi)
                else:
                    spans.append((layer, layer + 1, lo, hi))
            done = self.final is not None and all(s >= self.num_blocks for s in self._sent)
            return spans, self.final if done else None

    async def changed(self) -> None:
        """Until there is something to take (a report, the finish or a failure,
        from any thread)."""
        event = asyncio.Event()
        with self.lock:
            if self._has_news():
                return
            self._waiters.append((asyncio.get_running_loop(), event))
        await event.wait()

    async def wait_started(self) -> None:
        """Until the first report or the finish; raises the feed's error."""
        while not (self.started or self.final is not None or self.error is not None):
            await self.changed()
        if self.error is not None:
            raise self.error

    # ---- under the lock ----

    def _ready_blocks(self, tokens: int) -> int:
        return self.num_blocks if tokens >= self.num_tokens else tokens // self.block_size

    def _pin(self, block_ids: Sequence[int], upto: int) -> None:
        new = [i for i in range(upto) if self.block_ids[i] is None]
        if new:
            self.source.pin(self.holder, [block_ids[i] for i in new])
            for i in new:
                self.block_ids[i] = block_ids[i]

    def _complete(self, block_ids: Sequence[int]) -> None:
        self._pin(block_ids, self.num_blocks)
        self._tokens = [self.num_tokens] * len(self._tokens)

    def _fail(self, error: TransferError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _has_news(self) -> bool:
        """Something for ``take``: a span, the final, or the error."""
        if self.error is not None or self.final is not None:
            return True
        return any(self._ready_blocks(t) > s for t, s in zip(self._tokens, self._sent, strict=True))

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)
