"""One batched forward pass of a model over its own paged KV cache, outside
the engine's scheduler: the draft model's passes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import PrefillSlice, build_metadata, slice_table
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel


@dataclass(frozen=True)
class Chunk:
    block_table: list[int]  # covers positions [0, start + len(token_ids))
    start: int  # position of the first token; [0, start) are in the cache
    token_ids: list[int]


def last_token_logits(
    model: LlamaModel, cache: KVCache, chunks: list[Chunk], device: torch.device
) -> torch.Tensor:
    """Write every chunk's KV into the cache; logits of each chunk's last token,
    [len(chunks), V], in the order given."""
    bs = cache.layout.block_size
    # attention.py wants one-token chunks first, shortest context first.
    order = sorted(
        range(len(chunks)), key=lambda i: (len(chunks[i].token_ids) != 1, chunks[i].start)
    )
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSlice] = []
    last_rows = [0] * len(chunks)
    for i in order:
        c = chunks[i]
        n, table = len(c.token_ids), c.block_table
        span = range(c.start, c.start + n)
        if n == 1:
            decode_tables.append(table)
            decode_lens.append(c.start + 1)
        else:
            table_t = slice_table(table, device, model.gpu_attention)
            prefills.append(PrefillSlice(len(slots), n, c.start, table_t))
        input_ids += c.token_ids
        positions += span
        slots += [table[p // bs] * bs + p % bs for p in span]
        last_rows[i] = len(slots) - 1
    meta = build_metadata(
        bs, decode_tables, decode_lens, prefills, slots, device, fused=model.fused,
        gpu_kernel=model.gpu_attention,
    )  # fmt: skip
    hidden = model.forward(
        torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), meta, cache
    )
    return model.logits(hidden[last_rows])
