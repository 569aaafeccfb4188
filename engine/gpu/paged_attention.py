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
values are in the cache before the launch (engine/attention.py writes them).

A decode launch with few rows would leave most of the GPU idle (one program
per sequence and kv head), so its keys are split into ranges, one program
each ("flash decoding"); a second kernel merges the ranges' partial softmax
sums. The split count follows from the batch's shape alone (``key_splits``),
so a CUDA graph replays it.

The kernel is plain Triton, so it also runs under Triton's interpreter on
CPU tensors (TRITON_INTERPRET=1), which is how tests check it without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

_MIN_ROWS = 16  # tl.dot's smallest M
_PREFILL_ROWS = 64  # rows of a prompt tile: BLOCK_M * GROUP_P
_BLOCK_N = 64  # keys gathered per inner step
_MIN_SPLIT_KEYS = 256  # a decode row's keys are split into ranges of at least this many
_MAX_SPLITS = 64


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
        host = host.to(device, non_blocking=True)
        tables = tables.to(device, torch.long, non_blocking=True)  # int64 offsets in the kernel
        return cls(tables, host[0], host[1], host[2], max(q_lens))


@functools.cache
def _triton():
    """The triton module, imported on first need, or None: Triton ships with
    CUDA builds of torch; the host-only build has none."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def use_kernel(setting: str, device: torch.device, deterministic: bool) -> bool:
    """Whether an engine with ``EngineConfig.attention`` = ``setting`` runs this
    kernel on ``device``; raises where ``triton`` is asked for and cannot run."""
    if setting == "sdpa":
        return False
    if setting == "auto":
        return device.type == "cuda" and not deterministic and _triton() is not None
    if deterministic:
        raise ValueError("attention 'triton' is not row-invariant: deterministic mode refuses it")
    if _triton() is None:
        raise ValueError("attention 'triton' needs Triton, which is not installed")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention 'triton' needs a CUDA device (or TRITON_INTERPRET=1, in tests)")
    return True


@functools.cache
def _kernels():
    """The attention kernel and the one that merges split keys, compiled for the
    GPU on first launch; on a host where TRITON_INTERPRET=1 was set before
    Triton was imported, run by Triton's interpreter (CPU tensors: how tests
    check them without a GPU)."""
    from engine.gpu.attention_kernel import combine_splits_kernel, paged_attention_kernel

    triton = _triton()
    return triton.jit(paged_attention_kernel), triton.jit(combine_splits_kernel)


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs a decode launch aims for: two per multiprocessor."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def key_splits(batch: PagedBatch, block_size: int, kv_heads: int, device: torch.device) -> int:
    """How many ranges a decode launch splits each sequence's keys into: enough
    programs to fill the GPU, none shorter than _MIN_SPLIT_KEYS keys. Fixed by
    the batch's shape (rows, table width), as a CUDA graph needs."""
    if batch.max_q_len != 1:
        return 1
    rows, width = batch.tables.shape
    by_length = -(-width * block_size // _MIN_SPLIT_KEYS)
    by_occupancy = max(1, _target_programs(device) // (rows * kv_heads))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def attend(
    q: torch.Tensor,  # [N, heads, head_dim]
    kv: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    batch: PagedBatch,
    scale: float,
    splits: int | None = None,  # key ranges per decode row; None: key_splits()
) -> torch.Tensor:  # [N, heads, head_dim]
    """Each sequence's queries over its context in the cache (causal)."""
    attention, combine = _kernels()
    triton = _triton()
    _, heads, head_dim = q.shape
    block_size, kv_heads = kv.shape[2], kv.shape[3]
    if splits is None:
        splits = key_splits(batch, block_size, kv_heads, q.device)
    if splits > 1 and batch.max_q_len != 1:
        raise ValueError("keys are split for one-token (decode) launches only")
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    block_m = 1 if batch.max_q_len == 1 else max(1, _PREFILL_ROWS // group_p)
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(q)
    rows = batch.tables.shape[0]
    # partial sums of split keys, float32: acc [rows, splits, heads, head_dim], (m, l) pairs
    part_acc = torch.empty(rows * splits * heads * head_dim if splits > 1 else 1, device=q.device)
    part_ml = torch.empty(rows * splits * heads * 2 if splits > 1 else 1, device=q.device)
    keys, values = kv[0], kv[1]
    grid = (rows, triton.cdiv(batch.max_q_len, block_m) * splits, kv_heads)
    with _on(q.device):
        attention[grid](
            q, keys, values, out, part_acc, part_ml,
            batch.tables, batch.q_starts, batch.q_lens, batch.seq_lens, splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            batch.tables.stride(0), scale,
            GROUP=group, GROUP_P=group_p, BLOCK_M=block_m,
            ROWS=max(_MIN_ROWS, block_m * group_p), BLOCK_N=_BLOCK_N, BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )  # fmt: skip
        if splits > 1:
            combine[(rows, heads)](
                part_acc, part_ml, out, batch.q_starts, splits, out.stride(0), out.stride(1),
                SPLITS_P=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            )  # fmt: skip
    return out


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        return torch.cuda.device(device)
    return contextlib.nullcontext()
