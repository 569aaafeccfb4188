"""Attention over the paged KV cache.

One engine step runs a packed batch: the tokens of every scheduled
sequence laid end to end, no padding. Sequences that add one token this
step (decode, or a prefill whose last chunk is one token) come first and
are attended together; each sequence that adds several tokens (a prompt or
a prompt chunk) is attended on its own.

New keys and values are written into their slots first, so every query
reads its whole context, cached prefix included, from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kv_cache import KVCache


@dataclass
class PrefillSlice:
    start: int  # first token of this sequence in the packed batch
    num_tokens: int  # query tokens this step
    context_len: int  # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [num_tokens] long: flat slot of each new token
    num_decode: int  # the first num_decode tokens are one-token sequences
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool
    decode_len: int  # for num_decode == 1: that sequence's length (no mask needed)
    prefills: list[PrefillSlice]


def build_metadata(
    block_size: int,
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefills: list[PrefillSlice],
    slots: list[int],
    device: torch.device,
) -> AttentionMetadata:
    """Tensors shared by every layer of one step."""
    tables = mask = None
    if decode_tables:
        width = max(len(t) for t in decode_tables)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        tables = torch.tensor(padded, device=device)
        if len(decode_tables) > 1:
            positions = torch.arange(width * block_size, device=device)
            lens = torch.tensor(decode_lens, device=device)
            mask = (positions[None, :] < lens[:, None])[:, None, None, :]
    return AttentionMetadata(
        slots=torch.tensor(slots, device=device),
        num_decode=len(decode_tables),
        decode_block_tables=tables,
        decode_mask=mask,
        decode_len=decode_lens[0] if decode_lens else 0,
        prefills=prefills,
    )


def paged_attention(
    q: torch.Tensor,  # [N, heads, head_dim]
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [N, heads * head_dim]
    flat = cache.flat(layer)  # [2, num_blocks * block_size, kv_heads, head_dim]
    flat[0].index_copy_(0, meta.slots, k)
    flat[1].index_copy_(0, meta.slots, v)
    n, heads, head_dim = q.shape
    if not meta.prefills:  # all decode: no scatter into a packed output
        return _decode(q, cache.layers[layer], meta, scale).view(n, heads * head_dim)
    out = q.new_empty(n, heads, head_dim)
    if meta.num_decode:
        d = meta.num_decode
        out[:d] = _decode(q[:d], cache.layers[layer], meta, scale)
    for s in meta.prefills:
        out[s.start : s.start + s.num_tokens] = _prefill(q, k, v, cache.layers[layer], s, scale)
    return out.view(n, heads * head_dim)


def _decode(
    q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    # kv: [2, num_blocks, block_size, kv_heads, head_dim]
    b, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    tables = meta.decode_block_tables
    kv = kv.index_select(1, tables.view(-1))  # [2, b * max_blocks, block_size, kv_heads, head_dim]
    kv = kv.view(2, b, -1, kv_heads, head_dim)  # [2, b, tokens, kv_heads, head_dim]
    mask = meta.decode_mask
    if mask is None:  # one sequence: cut to its length instead of masking
        kv = kv[:, :, : meta.decode_len]
    keys, values = kv[0], kv[1]
    # Grouped-query trick: the query heads of one kv head act as its queries.
    qg = q.view(b, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(b, heads, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    s: PrefillSlice,
    scale: float,
) -> torch.Tensor:
    rows = slice(s.start, s.start + s.num_tokens)
    qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, t, head_dim]
    if s.context_len == 0:
        keys, values = k[rows], v[rows]
        mask, causal = None, True
    else:
        total = s.context_len + s.num_tokens
        context = kv.index_select(1, s.block_table).flatten(1, 2)[:, :total]
        keys, values = context[0], context[1]
        query_pos = torch.arange(s.context_len, total, device=q.device)[:, None]
        mask, causal = torch.arange(total, device=q.device)[None, :] <= query_pos, False
    out = F.scaled_dot_product_attention(
        qs,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)
