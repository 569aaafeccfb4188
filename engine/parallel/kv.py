"""KV blocks of a tensor-parallel pool, whole: each rank's heads gathered to
rank 0, or scattered from it, over the kv group (engine/parallel/group.py).

Blocks leave and enter a tensor-parallel worker with all their heads, in
head order, as a worker of tensor_parallel_size 1 holds them; that is what
lets a prefill pool of one size hand blocks to a decode pool of another
(engine/kv_layout.py): the sending worker's rank 0 gathers them before the
wire, the receiving one's rank 0 scatters them after it. This costs a copy
through rank 0 on each side; it keeps one transfer endpoint per worker, so
authentication, leases and the block bookkeeping stay rank 0's alone.

Rank 0 calls ``read`` and ``write`` from any thread (one at a time); the
other ranks answer on a thread of their own (``serve``), beside their step
loop. A transfer only touches blocks it holds, which no pass writes, so
the two never race; ``write`` returns once every rank has written. Rank 0
waits for the others at most ``group.KV_TIMEOUT`` in either: a rank that
hangs fails the transfer with GroupBroken (which frees what it held) and
breaks the group, instead of holding the transfer, its blocks and the
next transfer's turn forever.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache
from engine.parallel.group import RankGroup
from engine.parallel.messages import ReadKV, StopKV, WriteKV


class ShardedKV:
    """Rank 0's access to the whole blocks of every rank's cache."""

    def __init__(self, group: RankGroup, cache: KVCache) -> None:
        self.group = group
        self.cache = cache
        self._lock = threading.Lock()

    def read(self, block_ids: Sequence[int], layer_start: int, layer_end: int) -> torch.Tensor:
        """The blocks' K and V with every head, on the host:
        [layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]."""
        msg = ReadKV(list(block_ids), layer_start, layer_end)
        with self._lock:
            self.group.broadcast(self.group.kv, msg)
            parts = _read(self.group, self.cache, msg)
        assert parts is not None  # rank 0's
        return torch.cat(parts, dim=4)

    def write(self, block_ids: Sequence[int], layer_start: int, data: torch.Tensor) -> None:
        """Inverse of ``read``: ``data`` [layers, 2, n, block_size, num_kv_heads, head_dim]."""
        msg = WriteKV(list(block_ids), layer_start, layer_start + data.shape[0])
        parts = list(data.chunk(self.group.size, dim=4))
        with self._lock:
            self.group.broadcast(self.group.kv, msg)
            _write(self.group, self.cache, msg, parts)

    def stop(self) -> None:
        """End the other ranks' ``serve``."""
        if self.group.broken is None:
            with self._lock:
                self.group.broadcast(self.group.kv, StopKV())


def serve(group: RankGroup, cache: KVCache) -> None:
    """Ranks 1..N-1: answer rank 0's reads and writes until it stops."""
    while True:
        msg = group.broadcast(group.kv)
        if isinstance(msg, StopKV):
            return
        if isinstance(msg, ReadKV):
            _read(group, cache, msg)
        else:
            _write(group, cache, msg, None)


def _read(group: RankGroup, cache: KVCache, msg: ReadKV) -> list[torch.Tensor] | None:
    """This rank's heads of the blocks, gathered at rank 0 (None elsewhere)."""
    idx = _index(cache, msg.block_ids)
    local = torch.stack(
        [cache.layers[i].index_select(1, idx) for i in range(msg.layer_start, msg.layer_end)]
    )  # [layers, 2, n, block_size, rank_kv_heads, head_dim]
    return group.gather(group.kv, local.cpu())


def _write(
    group: RankGroup, cache: KVCache, msg: WriteKV, parts: list[torch.Tensor] | None
) -> None:
    layer = cache.layers[0]
    shape = (msg.layer_end - msg.layer_start, 2, len(msg.block_ids), *layer.shape[2:])
    mine = torch.empty(shape, dtype=layer.dtype)
    group.scatter(group.kv, parts, mine)
    idx = _index(cache, msg.block_ids)
    for i, values in enumerate(mine):
        target = cache.layers[msg.layer_start + i]
        target.index_copy_(1, idx, values.to(target.device))
    group.barrier(group.kv)  # rank 0 returns once every rank has written


def _index(cache: KVCache, block_ids: list[int]) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long, device=cache.layers[0].device)
