"""Transparent huge pages for the engine's large CPU tensors.

A decode step reads KV blocks scattered over the whole cache and every
packed weight: with 4 KB pages that is thousands of pages a step, more than
the TLB holds. On Linux, ``madvise(MADV_HUGEPAGE)`` asks for 2 MB pages
where transparent huge pages are in ``madvise`` mode (a common default);
the memory and its contents are the same either way, and where the call is
not available or refused nothing changes (PyTorch's own switch for this,
THP_MEM_ALLOC_ENABLE, is read once per process, at its first large
allocation, so the engine asks for its tensors itself).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = None


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MB pages of ``t``'s memory; pages
    already touched are merged later by the kernel. True if asked."""
    if _madvise is None or t.device.type != "cpu":
        return False
    start = t.data_ptr()
    end = start + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE
    hi = end // HUGE_PAGE * HUGE_PAGE
    return hi > lo and _madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, on huge pages where the system gives them (CPU, 2 MB and up)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise(t)  # before the first touch: the pages are huge when they fault in
    return t
