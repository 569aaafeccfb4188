"""The leak check every test ends with: no block holder left in a pool."""

from __future__ import annotations

from collections.abc import Iterable

from engine.block_pool import BlockPool, Holder


def leftover_holders(pool: BlockPool, own: Iterable[Holder] = ()) -> list[Holder]:
    """The holders ``pool`` has beyond ``own`` (an engine's scratch block),
    after checking its reference counts are exactly what its holders hold."""
    pool.verify()
    keep = set(own)
    return [holder for holder in pool.holders() if holder not in keep]
