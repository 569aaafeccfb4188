"""Paged KV cache: the layout two pools must share to move blocks, and the
tensors that hold the keys and values.

A block is ``block_size`` consecutive token slots of one sequence. The
block pool (engine/block_pool.py) owns the block ids: every reference to a
block belongs to a holder (a request, a transfer lease, a prefix pin, a
draft model, the engine's scratch block) and goes through the pool by that
holder; releasing a holder releases everything it holds. This module holds
the blocks' data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import hugepages
from engine.kv_layout import KVLayout


class KVCache:
    """One preallocated tensor per layer.

    layers[i]: [2, num_blocks, block_size, kv_heads, head_dim]
    (index 0 holds keys, 1 values); kv_heads is the layout's
    ``rank_kv_heads``: this rank's share under tensor parallelism. ``flat(i)``
    views the same memory as [2, num_blocks * block_size, kv_heads, head_dim]
    for slot writes.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        dtype = getattr(torch, layout.dtype)
        shape = (2, num_blocks, layout.block_size, layout.rank_kv_heads, layout.head_dim)
        self.layers = [
            hugepages.empty(shape, dtype, device).zero_() for _ in range(layout.num_layers)
        ]
        self._flat = [t.view(2, num_blocks * layout.block_size, *shape[3:]) for t in self.layers]

    def flat(self, layer: int) -> torch.Tensor:
        return self._flat[layer]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy of the given blocks: [num_layers, 2, n, block_size, kv_heads, head_dim]."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        return torch.stack([t.index_select(1, idx) for t in self.layers])

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.layers[0].device)
        for layer, t in enumerate(self.layers):
            t.index_copy_(1, idx, data[layer].to(device=t.device, dtype=t.dtype))

    @staticmethod
    def blocks_for_budget(layout: KVLayout, memory_bytes: int) -> int:
        """Blocks that fit in ``memory_bytes`` of each rank's cache."""
        return max(1, memory_bytes // layout.rank_block_bytes)
