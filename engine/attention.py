"""Attention over the paged KV cache.

One engine step runs a packed batch: the tokens of every scheduled
sequence laid end to end, no padding. Sequences that add one token this
step (decode, or a prefill whose last chunk is one token) come first and
are attended together; each sequence that adds several tokens (a prompt or
a prompt chunk) is attended on its own.

New keys and values are written into their slots first, so every query
reads its whole context, cached prefix included, from the cache. Three
paths: the fused CPU kernels (engine/kernels/), one Triton kernel for the
whole step on a GPU (engine/gpu/paged_attention.py), and the PyTorch
reference (SDPA over gathered blocks) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.gpu import paged_attention as triton_attention
from engine.gpu.paged_attention import PagedBatch
from engine.kv_cache import KVCache


@dataclass
class PrefillSlice:
    start: int  # first token of this sequence in the packed batch
    num_tokens: int  # query tokens this step
    context_len: int  # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_blocks] long


@dataclass
class DecodeGroup:
    """One-token sequences of similar length, attended as one padded batch."""

    start: int  # first of them in the packed batch
    size: int
    block_tables: torch.Tensor  # [size, max_blocks] long, padded with block 0
    mask: torch.Tensor | None  # [size, 1, 1, max_blocks * block_size] bool; None if size 1
    length: int  # for size 1: the sequence's length (cut instead of masked)


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [num_tokens] long: flat slot of each new token
    num_decode: int  # the first num_decode tokens are one-token sequences
    decode_groups: list[DecodeGroup]  # for the PyTorch path (empty when fused)
    prefills: list[PrefillSlice]
    # For the fused kernel (engine/kernels/): every decode row's block table,
    # padded to the widest, [num_decode, width] long, and context lengths.
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # Deterministic mode: every sequence is a PrefillSlice (a decode one of one
    # token) and each query row is attended so that its sums depend on it alone.
    row_invariant: bool = False
    # On a GPU: every sequence of the step, decode rows first, for the Triton
    # kernel that reads the cache in place (engine/gpu/paged_attention.py).
    paged: PagedBatch | None = None


# The fused prefill kernel (engine/kernels/prefill_attention.cpp) holds each
# query row's scores over the whole context; past this many keys SDPA's
# blocked flash attention is faster (one thread, 32-wide heads: 1.3x at 256
# tokens, 1.1x at 1024, even at 2048, 0.69x at 4096).
FUSED_PREFILL_MAX_KEYS = 2048

# A decode batch is split where padding would grow past this factor, so that
# short sequences do not pay for the longest one's context.
_MAX_PADDING = 1.5
_MIN_GROUP = 8


def _group_bounds(num_blocks: list[int]) -> list[tuple[int, int]]:
    """[start, end) ranges over sequences sorted by length."""
    bounds, start = [], 0
    for i in range(1, len(num_blocks)):
        if i - start >= _MIN_GROUP and num_blocks[i] > _MAX_PADDING * num_blocks[start]:
            bounds.append((start, i))
            start = i
    bounds.append((start, len(num_blocks)))
    return bounds


def build_metadata(
    block_size: int,
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefills: list[PrefillSlice],
    slots: list[int],
    device: torch.device,
    fused: bool = False,
    row_invariant: bool = False,
    gpu_kernel: bool = False,
) -> AttentionMetadata:
    """Tensors shared by every layer of one step. Decode sequences come
    sorted by length, shortest first (groups then pad little; tables of one
    group may still differ in length, e.g. a draft model's). ``fused``: for
    the fused decode kernel, which reads every table itself (no groups).
    ``row_invariant``: deterministic mode, which has no decode rows.
    ``gpu_kernel``: every sequence goes to the Triton kernel that reads the
    cache in place (the model's ``gpu_attention``)."""
    if row_invariant:
        if decode_tables:
            raise ValueError("row-invariant attention takes one-token sequences as prefills")
        return AttentionMetadata(
            torch.tensor(slots, device=device), 0, [], prefills, row_invariant=True
        )
    if fused:
        tables = lens = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables])
            lens = torch.tensor(decode_lens)
        return AttentionMetadata(
            torch.tensor(slots, device=device), len(decode_tables), [], prefills, tables, lens
        )
    if gpu_kernel:
        paged = _paged_batch(decode_tables, decode_lens, prefills, device)
        return AttentionMetadata(
            torch.tensor(slots, device=device), len(decode_tables), [], prefills, paged=paged
        )
    groups = []
    for start, end in _group_bounds([len(t) for t in decode_tables]) if decode_tables else []:
        tables = decode_tables[start:end]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        mask = None
        if end - start > 1:
            positions = torch.arange(width * block_size, device=device)
            lens = torch.tensor(decode_lens[start:end], device=device)
            mask = (positions[None, :] < lens[:, None])[:, None, None, :]
        groups.append(DecodeGroup(start, end - start, padded, mask, decode_lens[start]))
    return AttentionMetadata(
        slots=torch.tensor(slots, device=device),
        num_decode=len(decode_tables),
        decode_groups=groups,
        prefills=prefills,
    )


def slice_table(table: list[int], device: torch.device, gpu_kernel: bool) -> torch.Tensor:
    """A prompt slice's block table where its attention reads it: on the host
    for the GPU kernel (``build_metadata`` packs every table of the step into
    one copy), else on ``device``."""
    return torch.tensor(table, device=None if gpu_kernel else device)


def _paged_batch(
    decode_tables: list[list[int]],
    decode_lens: list[int],
    prefills: list[PrefillSlice],
    device: torch.device,
) -> PagedBatch:
    """The step for the GPU kernel: decode rows (one query token each) first,
    then the prompt slices (tables from ``slice_table``)."""
    nd = len(decode_tables)
    tables = decode_tables + [s.block_table.tolist() for s in prefills]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    q_starts = list(range(nd)) + [s.start for s in prefills]
    q_lens = [1] * nd + [s.num_tokens for s in prefills]
    seq_lens = decode_lens + [s.context_len + s.num_tokens for s in prefills]
    return PagedBatch.build(padded, q_starts, q_lens, seq_lens, device)


def paged_attention(
    q: torch.Tensor,  # [N, heads, head_dim]
    k: torch.Tensor,  # [N, kv_heads, head_dim]
    v: torch.Tensor,  # [N, kv_heads, head_dim]
    cache: KVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    ops=None,  # engine.kernels.cpu_ops(), for the fused decode kernel
) -> torch.Tensor:  # [N, heads * head_dim]
    """With ``ops``, the step's keys and values are already in the cache (the
    kernel ``rope_store_kv`` put them there), the decode rows go to the
    fused kernel (``meta`` built with ``fused=True``) and so do prompts of up
    to FUSED_PREFILL_MAX_KEYS keys; else they are stored here and attended by
    the GPU kernel (``meta.paged``), or in ``meta.decode_groups`` and prompts
    with SDPA."""
    kv = cache.layers[layer]
    if ops is None:
        flat = cache.flat(layer)  # [2, num_blocks * block_size, kv_heads, head_dim]
        flat[0].index_copy_(0, meta.slots, k)
        flat[1].index_copy_(0, meta.slots, v)
    n, heads, head_dim = q.shape
    if meta.paged is not None:
        return triton_attention.attend(q, kv, meta.paged, scale).view(n, heads * head_dim)
    nd, groups = meta.num_decode, meta.decode_groups
    if not meta.prefills:  # the common decode step: no scatter
        if ops is not None:
            return ops.paged_decode_attention(q, kv, meta.decode_tables, meta.decode_lens, scale)
        if len(groups) == 1:
            return _decode(q, kv, groups[0], scale).view(n, heads * head_dim)
    out = q.new_empty(n, heads, head_dim)
    if ops is not None and nd:
        decoded = ops.paged_decode_attention(
            q[:nd], kv, meta.decode_tables, meta.decode_lens, scale
        )
        out[:nd] = decoded.view(nd, heads, head_dim)
    for g in groups:
        rows = slice(g.start, g.start + g.size)
        out[rows] = _decode(q[rows], kv, g, scale)
    for s in meta.prefills:
        rows = slice(s.start, s.start + s.num_tokens)
        if meta.row_invariant and ops is None:
            out[rows] = _prefill_by_rows(q[rows], kv, s, scale)
        elif ops is not None and (
            meta.row_invariant or s.context_len + s.num_tokens <= FUSED_PREFILL_MAX_KEYS
        ):  # the fused kernel's sums for a row depend on it alone (prefill_attention.cpp)
            fused = ops.paged_prefill_attention(q[rows], kv, s.block_table, s.context_len, scale)
            out[rows] = fused.view(s.num_tokens, heads, head_dim)
        else:
            out[rows] = _prefill(q, k, v, kv, s, scale)
    return out.view(n, heads * head_dim)


def _decode(q: torch.Tensor, kv: torch.Tensor, g: DecodeGroup, scale: float) -> torch.Tensor:
    # kv: [2, num_blocks, block_size, kv_heads, head_dim]
    b, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    kv = kv.index_select(1, g.block_tables.view(-1))  # [2, b * max_blocks, block_size, ...]
    kv = kv.view(2, b, -1, kv_heads, head_dim)  # [2, b, tokens, kv_heads, head_dim]
    if g.mask is None:  # one sequence: cut to its length instead of masking
        kv = kv[:, :, : g.length]
    keys, values = kv[0], kv[1]
    # Grouped-query trick: the query heads of one kv head act as its queries.
    qg = q.view(b, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=g.mask, scale=scale
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


def _prefill_by_rows(
    q: torch.Tensor, kv: torch.Tensor, s: PrefillSlice, scale: float
) -> torch.Tensor:
    """Deterministic mode's PyTorch attention: each query row (position p) over
    keys [0, p] on its own, so every op sees the shapes of that row alone."""
    total = s.context_len + s.num_tokens
    context = kv.index_select(1, s.block_table).flatten(1, 2)[:, :total]
    t, heads, head_dim = q.shape
    kv_heads = context.shape[2]
    keys = context[0].permute(1, 2, 0)  # [kv_heads, head_dim, total]
    values = context[1].transpose(0, 1)  # [kv_heads, total, head_dim]
    out = q.new_empty(t, heads, head_dim)
    for i in range(t):
        seen = s.context_len + i + 1
        qg = q[i].view(kv_heads, heads // kv_heads, head_dim)
        weights = torch.softmax(torch.matmul(qg, keys[..., :seen].contiguous()) * scale, dim=-1)
        out[i] = torch.matmul(weights, values[:, :seen].contiguous()).view(heads, head_dim)
    return out
