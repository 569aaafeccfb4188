"""The block index: which worker's KV cache holds which prefix blocks.

``InMemoryIndex`` is the default (one machine, no server). The Redis
backend (``RedisIndex`` for routers, ``RedisEventPublisher`` for workers)
is imported lazily, so the in-process index needs no redis client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from block_index.base import (
    HASH_SIZE,
    BlockIndex,
    EventPublisher,
    IndexSettings,
    KVEvent,
    TierCounts,
    TieredIndex,
)
from block_index.memory import InMemoryIndex, InProcessPublisher
from block_index.reconcile import ReconcileReport, reconcile

if TYPE_CHECKING:
    from block_index.redis_index import RedisEventPublisher, RedisIndex, redis_prefix

__all__ = [
    "HASH_SIZE",
    "BlockIndex",
    "EventPublisher",
    "InMemoryIndex",
    "InProcessPublisher",
    "IndexSettings",
    "KVEvent",
    "ReconcileReport",
    "RedisEventPublisher",
    "RedisIndex",
    "TierCounts",
    "TieredIndex",
    "reconcile",
    "redis_prefix",
]

_LAZY = {"RedisEventPublisher", "RedisIndex", "redis_prefix"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from block_index import redis_index

        return getattr(redis_index, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
