"""engine.sched_policy: a process's threads, present and future, change policy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies"),
]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, threading
from engine.sched_policy import set_policy

def policy_in_new_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
    t.start(); t.join()
    return seen[0]

early = []
gate = threading.Event()
t = threading.Thread(target=lambda: (gate.wait(), early.append(os.sched_getscheduler(0))))
t.start()  # started before the change: it changes too
assert set_policy(batch=True) and os.sched_getscheduler(0) == os.SCHED_BATCH
gate.set(); t.join()
assert early == [os.SCHED_BATCH], early
assert policy_in_new_thread() == os.SCHED_BATCH
assert set_policy(batch=False) and os.sched_getscheduler(0) == os.SCHED_OTHER
assert policy_in_new_thread() == os.SCHED_OTHER
print("ok")
"""


def test_every_thread_changes_and_new_ones_inherit():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


NICE_SCRIPT = """
import os, threading
from engine.sched_policy import set_niceness

def nice_of_new_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0)))
    t.start(); t.join()
    return seen[0]

target = os.getpriority(os.PRIO_PROCESS, 0) + 3  # raising it needs no privilege
early, gate = [], threading.Event()
t = threading.Thread(
    target=lambda: (gate.wait(), early.append(os.getpriority(os.PRIO_PROCESS, 0)))
)
t.start()  # started before the change: it changes too
assert set_niceness(target)
gate.set(); t.join()
assert early == [target], early
assert os.getpriority(os.PRIO_PROCESS, 0) == target and nice_of_new_thread() == target
print("ok")
"""


def test_every_thread_takes_the_nice_value_and_new_ones_inherit():
    out = subprocess.run(
        [sys.executable, "-c", NICE_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
