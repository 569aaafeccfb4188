"""The block index interfaces: what workers write and what routers read.

A worker's KV cache holds blocks named by their chained hash (16 bytes, see
``engine.hashing``). Workers report what their cache gained (``stored``) and
lost (``removed``) as :class:`KVEvent` values through an
:class:`EventPublisher`; routers ask a :class:`BlockIndex`, for a request's
hash chain, how many leading blocks each worker holds.

The index is advice, never truth: an entry may be stale (a block evicted
after the event was sent), which costs the caller a cache miss, never an
error. ``lookup`` never raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from engine.hashing import DIGEST_SIZE

HASH_SIZE = DIGEST_SIZE
"""Bytes in one block hash (``engine.hashing``: blake2b-128)."""


@dataclass(frozen=True)
class KVEvent:
    """One change to one worker's cached blocks.

    Applied in this order: ``reset`` (drop all of the worker's entries),
    then ``removed``, then ``stored``. A worker that restarted or cleared its
    cache sends ``reset=True`` with its full content in ``stored``.

    ``host``: the hashes of ``stored`` that the worker holds only in its
    second KV tier (engine/kv_tier.py), not on its device; the others of
    ``stored`` are on its device. A backend that keeps no tier (Redis)
    counts both alike.
    """

    worker: str
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    reset: bool = False
    host: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class TierCounts:
    """A worker's leading blocks of a hash chain (``BlockIndex.lookup``), and
    how many of them are only in its host tier."""

    blocks: int
    host: int = 0
    device_lead: int | None = None
    """Leading blocks before the first host-only one (None: all ``blocks``,
    when none is host-only). A KV pull can take only these from the worker:
    its pool lends device blocks (kv_transfer/pool_store.py ``pin_hashes``)."""

    @property
    def device(self) -> int:
        return self.blocks - self.host

    @property
    def pullable(self) -> int:
        """Leading blocks a KV pull from this worker can take."""
        return self.blocks if self.device_lead is None else self.device_lead


@runtime_checkable
class TieredIndex(Protocol):
    """An index that also knows which tier holds each block."""

    def lookup_tiers(self, hashes: Sequence[bytes]) -> dict[str, TierCounts]:
        """``lookup``, with the host-tier share of each worker's count."""
        ...


@runtime_checkable
class BlockIndex(Protocol):
    """What a router reads."""

    def apply(self, event: KVEvent) -> None:
        """Apply one event in-process (events piggybacked to the router)."""
        ...

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """Worker -> number of LEADING hashes of ``hashes`` it holds.

        Only workers holding at least the first hash appear. Never raises;
        returns ``{}`` when the index is unhealthy.
        """
        ...

    def drop_worker(self, worker: str) -> None:
        """Forget every entry of ``worker`` (it died or left)."""
        ...

    def workers(self) -> set[str]:
        """The workers the index currently knows."""
        ...

    @property
    def healthy(self) -> bool:
        """False while a backend is unreachable: route by load only then."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class EventPublisher(Protocol):
    """What a worker writes to."""

    def publish(self, event: KVEvent) -> None:
        """Hand an event over. Never raises into the engine, never blocks long."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class IndexSettings:
    """Where a worker publishes its prefix cache's changes."""

    redis_url: str | None = None  # None: on the output streams, to the routers' index
    redis_password: str | None = field(default=None, repr=False)  # AUTH, unless in the URL
    deployment: str = "default"
    heartbeat_s: float = 2.0
    ttl_s: float = 10.0
