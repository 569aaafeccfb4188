"""Admission by KV capacity: a request waits in the router until a decode
worker has room for it, instead of failing because the pool is full now.

Each decode worker reports its room on its output stream
(``StepBatch.room``: free and evictable blocks, less what its running
sequences and pushes in flight need to reach their max_tokens; see
decode_pool/reserve.py). ``KVRooms`` keeps those reports, less the blocks
this router has promised since (tries routed whose push has not started
yet). A request needs the blocks of its longest length (prompt, tokens
already streamed, and the rest of max_tokens); it goes to a worker where
that fits (``fits_room``). The prefix the worker holds is not taken off: the
reported room counts idle cached blocks as free already, and a request that
takes them takes them out of that room (engine/scheduler.py checks its
longest length against the room so), so taking them off would count them
twice.

A request that fits nowhere waits in ``AdmissionQueue``: higher priority
first, first come first served within a priority, with no overtaking (a
request never starts before one ranked ahead of it, so a big request is
not starved by small ones). The queue holds at most ``max_waiting``
requests (``limits.max_waiting_requests``); past it a request is refused
at once. A waiting request is bounded by its deadline (the caller's), and
woken when a worker reports room. The decode worker checks again on its
own view (several routers share it, and this view can be stale): a push
that does not fit there waits there; one that waited past its bound
(``PushNoRoom``) is not a failed try: the backend queues the request here
again, within its deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from router.messages import RequestError

T = TypeVar("T")


class QueueFull(Exception):
    """The admission queue holds ``max_waiting`` requests already."""


@dataclass(order=True)
class Ticket(Generic[T]):
    """A request's place in the queue."""

    rank: tuple[int, int]  # (-priority, arrival): smallest first
    item: T = field(compare=False)
    waiting: bool = field(default=True, compare=False)


class AdmissionQueue(Generic[T]):
    """Requests waiting for room, in the order they may start."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._heap: list[Ticket[T]] = []
        self._count = 0  # tickets waiting (the heap also keeps removed ones until popped)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return self._count

    def may_go_first(self, priority: int) -> bool:
        """Whether a new request of ``priority`` may start before every
        waiting one: none ranks ahead of it (all have a lower priority)."""
        self._pop_removed()
        return not self._heap or -self._heap[0].rank[0] < priority

    def push(self, item: T, priority: int) -> Ticket[T]:
        """Queue ``item``; QueueFull if ``max_waiting`` wait already."""
        if self._count >= self.max_waiting:
            raise QueueFull(f"{self._count} requests wait for KV room already")
        ticket = Ticket((-priority, next(self._arrivals)), item)
        heapq.heappush(self._heap, ticket)
        self._count += 1
        return ticket

    def remove(self, ticket: Ticket[T]) -> None:
        """Take a waiting ticket out (its deadline passed, its client left)."""
        if ticket.waiting:
            ticket.waiting = False
            self._count -= 1

    def admit(self, start: Callable[[T], bool]) -> list[T]:
        """Start waiting requests in order while ``start(item)`` says it
        started (it found room); the items started, in order."""
        started = []
        while True:
            self._pop_removed()
            if not self._heap or not start(self._heap[0].item):
                return started
            ticket = heapq.heappop(self._heap)
            ticket.waiting = False
            self._count -= 1
            started.append(ticket.item)

    def _pop_removed(self) -> None:
        while self._heap and not self._heap[0].waiting:
            heapq.heappop(self._heap)


@dataclass(frozen=True)
class Room:
    free_blocks: int
    total_blocks: int


class KVRooms:
    """Each decode worker's room as it last reported it, less what this
    router promised since."""

    def __init__(self) -> None:
        self._reported: dict[str, Room] = {}
        self._promised: dict[str, int] = {}

    def report(self, worker: str, room: Room) -> None:
        self._reported[worker] = room

    def forget(self, worker: str) -> None:
        self._reported.pop(worker, None)
        self._promised.pop(worker, None)

    def total(self, worker: str) -> int | None:
        """The worker's whole pool; None before its first report."""
        room = self._reported.get(worker)
        return room.total_blocks if room is not None else None

    def free(self, worker: str) -> int | None:
        """Blocks a request may take there now; None before its first report."""
        room = self._reported.get(worker)
        if room is None:
            return None
        return room.free_blocks - self._promised.get(worker, 0)

    def promise(self, worker: str, blocks: int) -> None:
        self._promised[worker] = self._promised.get(worker, 0) + blocks

    def settle(self, worker: str, blocks: int) -> None:
        """A promise the worker's reports cover now (its push started), or
        that ended."""
        left = self._promised.get(worker, 0) - blocks
        if left > 0:
            self._promised[worker] = left
        else:
            self._promised.pop(worker, None)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def fits_room(longest: int, total: int | None, free: int | None) -> tuple[bool, int]:
    """Whether a request of ``longest`` blocks fits in a worker's reported
    room ``free`` (its pool ``total``; None: no report yet, it fits), and the
    blocks to promise there. The worker's cached copy of the prompt's prefix
    is not taken off (see the module docstring)."""
    need = min(longest, total) if total is not None else longest
    return free is None or need <= free, need if free is not None else 0


def longest_blocks(prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int) -> int:
    """Blocks a request holds at its longest on a decode worker (the last
    token sampled is never computed), as the worker's reserve counts them."""
    longest = prompt_tokens + max_tokens - 1
    if max_model_len:
        longest = min(longest, max_model_len)
    return blocks_for(longest, block_size)


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """A request's route, and the blocks promised for it on its decode worker."""

    route: T
    worker: str
    blocks: int


Route = Callable[[], "Admitted | None"]
"""Route the request where it fits now (promising its blocks there), or None."""


@dataclass(eq=False)
class _Waiter:
    route: Route
    future: asyncio.Future


class Admitter:
    """The queue and the rooms together, for the backend's event loop."""

    def __init__(self, max_waiting: int) -> None:
        self.rooms = KVRooms()
        self.queue: AdmissionQueue[_Waiter] = AdmissionQueue(max_waiting)
        self.num_queued = 0  # requests that waited (stats)

    async def admit(self, route: Route, priority: int) -> Admitted:
        """Route now if no waiting request ranks ahead and it fits, else wait
        in line until a report of room lets it start (the caller's deadline
        bounds the wait). RequestError RESOURCE_EXHAUSTED when the queue is full."""
        if self.queue.may_go_first(priority):
            admitted = route()
            if admitted is not None:
                return admitted
        future = asyncio.get_running_loop().create_future()
        try:
            ticket = self.queue.push(_Waiter(route, future), priority)
        except QueueFull as exc:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode worker has KV room and {exc} (limits.max_waiting_requests "
                f"{self.queue.max_waiting}); retry later",
            ) from None
        self.num_queued += 1
        try:
            return await future
        except BaseException:
            self.queue.remove(ticket)
            if future.done() and not future.cancelled() and future.exception() is None:
                self.settle(future.result())  # started, but its caller is gone
            raise

    def report(self, worker: str, room: Room) -> None:
        self.rooms.report(worker, room)
        self.wake()

    def settle(self, admitted: Admitted) -> None:
        """Its decode worker's reports cover its blocks now, or its try ended."""
        if admitted.blocks:
            self.rooms.settle(admitted.worker, admitted.blocks)
            self.wake()

    def wake(self) -> None:
        """Start the waiting requests that fit now, in order."""
        self.queue.admit(_start)


def _start(waiter: _Waiter) -> bool:
    if waiter.future.done():  # its caller is gone (removed, but not popped yet)
        return True
    try:
        admitted = waiter.route()
    except Exception as exc:  # e.g. no worker in routing: the caller handles it
        waiter.future.set_exception(exc)
        return True
    if admitted is None:
        return False
    waiter.future.set_result(admitted)
    return True
