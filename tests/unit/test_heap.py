"""worker.heap: a serving process freezes what it built before serving; the
collector's passes then leave those objects alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# In a child process: freezing this test session's heap would keep every
# engine a later test drops and leaves in a reference cycle.
SCRIPT = """
import gc
from worker.heap import freeze_startup_heap

class Node:
    pass

kept = [Node() for _ in range(1000)]
for a, b in zip(kept, kept[1:]):
    a.next, b.prev = b, a  # a cycle
assert gc.get_freeze_count() == 0
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count() and frozen > 1000, frozen
tracked = len(gc.get_objects())  # what a full collection walks
assert tracked < 1000, tracked
late = Node()
late.me = late
del late
assert gc.collect() >= 1  # objects made after the freeze are still collected
print("ok", frozen)
"""


def test_freeze_moves_the_startup_heap_out_of_the_collectors_passes():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ok ")
