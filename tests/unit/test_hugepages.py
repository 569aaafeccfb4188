"""engine.hugepages: huge-page advice changes no tensor's shape or contents."""

from __future__ import annotations

import sys

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


def test_only_whole_huge_pages_are_advised():
    assert not hugepages.advise(torch.empty(1000))  # no whole 2 MB page inside
    big = torch.empty(4 << 20)  # 16 MB: several whole pages, whatever its alignment
    assert hugepages.advise(big) == (hugepages._madvise is not None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_linux_has_the_call():
    assert hugepages._madvise is not None


def test_packed_weights_keep_their_values():
    w = torch.randn(300, 70000)  # panels of 84 MB: on advised memory
    packed = PackedWeight.pack(w)
    assert packed.out_features == 70000
    unpacked = packed.panels.transpose(0, 1).reshape(300, -1)[:, :70000]
    assert torch.equal(unpacked, w)
