"""Attention that reads the paged KV cache in place, on a GPU, as one Triton kernel.

One launch attends every sequence of a step: decode rows (one query token)
and prompt chunks (many query tokens over a cached prefix) alike. A program
takes one sequence, one tile of its query tokens and one kv head; it walks
the sequence's block table and gathers keys and values straight from the
cache blocks, with an online softmax in float32. Nothing is copied out of
the cache, and no mask tensor is built, so the same launch serves a CUDA
graph (engine/cuda_graphs.py) at a fixed batch shape.

Rows of a program: the query heads that share the kv head (grouped-query
attention), for each query token of the tile, laid out token-major::

    row r -> token (tile * BLOCK_M + r // GROUP_P), head (kv_head * GROUP + r % GROUP_P)

padded to at least 16 rows (the smallest matrix product Triton emits).
A query at absolute position p sees keys [0, p]; the step's own keys and
values are in the cache before the launch (``paged_attention`` writes them).

The kernel is plain Triton, so it also runs under Triton's interpreter on
CPU tensors (TRITON_INTERPRET=1), which is how tests check it without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_MIN_ROWS = 16  # tl.dot's smallest M
_PREFILL_ROWS = 64  # rows of a prompt tile: BLOCK_M * GROUP_P
_BLOCK_N = 64  # keys gathered per inner step


@dataclass
class PagedBatch:
    """A step's sequences for the kernel, on the cache's device.

    Sequence i owns query rows [q_starts[i], q_starts[i] + q_lens[i]) of the
    packed batch; its context after this step is seq_lens[i] tokens, read
    through tables[i] (padded with any valid block id). ``max_q_len`` must be
    a bound of ``q_lens`` (a CUDA graph replays one launch grid)."""

    tables: torch.Tensor  # [S, width] long
    q_starts: torch.Tensor  # [S] long
    q_lens: torch.Tensor  # [S] long
    seq_lens: torch.Tensor  # [S] long
    max_q_len: int  # the widest query span: sets the launch grid

    @classmethod
    def build(
        cls,
        tables: torch.Tensor,  # [S, width] long, on the host
        q_starts: list[int],
        q_lens: list[int],
        seq_lens: list[int],
        device: torch.device,
    ) -> PagedBatch:
        host = torch.tensor([q_starts, q_lens, seq_lens], dtype=torch.long)
        host, tables = host.to(device, non_blocking=True), tables.to(device, non_blocking=True)
        return cls(tables, host[0], host[1], host[2], max(q_lens))


@functools.cache
def _triton():
    """The triton module, imported on first need (it takes a fifth of a second),
    or None: Triton ships with CUDA builds of torch; the host-only build has none."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``'s tensors: a GPU with Triton."""
    return device.type == "cuda" and _triton() is not None


@functools.cache
def _kernel():
    """The kernel, compiled for the GPU on first launch; on a host where
    TRITON_INTERPRET=1 was set before Triton was imported, Triton's interpreter
    (CPU tensors: how tests check it without a GPU)."""
    triton = _triton()
    if triton is None:
        raise RuntimeError("the GPU attention kernel needs Triton, which is not installed")
    from engine.gpu.attention_kernel import attend

    return triton.jit(attend)


def paged_attention(
    q: torch.Tensor,  # [N, heads, head_dim]
    kv: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    batch: PagedBatch,
    scale: float,
    out: torch.Tensor | None = None,  # [N, heads, head_dim]
) -> torch.Tensor:  # [N, heads, head_dim]
    """Each sequence's queries over its context in the cache (causal)."""
    kernel, triton = _kernel(), _triton()
    _, heads, head_dim = q.shape
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    block_m = 1 if batch.max_q_len == 1 else max(1, _PREFILL_ROWS // group_p)
    rows = max(_MIN_ROWS, block_m * group_p)
    out = torch.empty_like(q) if out is None else out
    keys, values = kv[0], kv[1]
    grid = (batch.tables.shape[0], triton.cdiv(batch.max_q_len, block_m), kv_heads)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    kernel[grid](
        q, keys, values, out,
        batch.tables, batch.q_starts, batch.q_lens, batch.seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        batch.tables.stride(0), scale,
        GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, ROWS=rows,
        BLOCK_N=_BLOCK_N, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PRECISION=precision,
    )  # fmt: skip
    return out
