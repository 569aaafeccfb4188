"""engine.hugepages: huge-page advice changes no tensor's shape or contents."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from engine import hugepages
from engine.kernels import PackedWeight

pytestmark = pytest.mark.unit


def test_empty_has_the_shape_and_dtype_asked_for():
    t = hugepages.empty((3, 1 << 20), torch.float32, torch.device("cpu"))
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * 3 * (1 << 20)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                span = (lo, hi)
            elif head == "VmFlags:" and span and span[0] <= address < span[1]:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_tensor_without_a_whole_huge_page_is_not_advised():
    assert not hugepages.advise(torch.empty(1000))


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists(), reason="no transparent huge pages (Linux only)")
def test_the_kernel_marks_exactly_the_whole_huge_pages_inside_the_tensor():
    # A fresh mapping of its own (no earlier advice on it) and a tensor in it
    # that starts off a huge-page boundary.
    buf = mmap.mmap(-1, 24 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    offset = 4096 if (base + 4096) % hugepages.HUGE_PAGE else 8192
    big = torch.frombuffer(buf, dtype=torch.float32, offset=offset, count=4 << 20)  # 16 MB
    start = big.data_ptr()
    end = start + big.numel() * big.element_size()
    first = -(-start // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    last = end // hugepages.HUGE_PAGE * hugepages.HUGE_PAGE
    assert "hg" not in _vm_flags(first)
    assert hugepages.advise(big)
    assert "hg" in _vm_flags(first)  # MADV_HUGEPAGE, as the kernel recorded it
    assert "hg" in _vm_flags(last - 1)
    # Only whole pages: the partial page at each end is left as it was.
    assert "hg" not in _vm_flags(start) and "hg" not in _vm_flags(first - 1)
    if last < end:
        assert "hg" not in _vm_flags(last)


def test_packed_weights_keep_their_values():
    w = torch.randn(300, 70000)  # panels of 84 MB: on advised memory
    packed = PackedWeight.pack(w)
    assert packed.out_features == 70000
    unpacked = packed.panels.transpose(0, 1).reshape(300, -1)[:, :70000]
    assert torch.equal(unpacked, w)
