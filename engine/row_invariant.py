"""Deterministic mode's one device for torch code: run a row-local function on
each row by itself.

A batched torch op (a matmul, a reduction, an elementwise op with a vector
body and a scalar tail) may sum a row in an order that depends on how many
rows it was given and where the row sits among them. The same op called on
one row, always with the same shape, computes that row the same way every
time; so outputs depend on nothing but the row (docs/deterministic.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def each_row(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    """``fn`` applied to row i of every ``xs`` (as [1, ...] slices), for each i,
    the results concatenated: [N, ...] like ``fn(*xs)`` (a tuple of them when
    ``fn`` returns a tuple of tensors)."""
    n = xs[0].shape[0]
    if n == 1:
        return fn(*xs)
    results = [fn(*(x[i : i + 1] for x in xs)) for i in range(n)]
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results, strict=True))
    return torch.cat(results)


def whole(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    """``fn`` on the whole batch: each_row's counterpart outside deterministic mode."""
    return fn(*xs)
