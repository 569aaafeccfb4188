"""worker.sched_policy and worker.cpu_binding: a process's threads, present
and future, change scheduling policy, nice value and cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, threading
from worker.cpu_binding import bind_process
from worker.sched_policy import set_niceness, set_policy

def get():
    return {get}

def in_new_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(get()))
    t.start(); t.join()
    return seen[0]

target = {target}
early, gate = [], threading.Event()
t = threading.Thread(target=lambda: (gate.wait(), early.append(get())))
t.start()  # started before the change: it changes too
assert {change}
gate.set(); t.join()
assert early == [target], early
assert get() == target and in_new_thread() == target
print("ok")
"""
CASES = {
    "policy": ("os.sched_getscheduler(0)", "os.SCHED_BATCH", "set_policy(batch=True)"),
    # Raising a nice value needs no privilege.
    "niceness": ("os.getpriority(os.PRIO_PROCESS, 0)", "get() + 3", "set_niceness(target)"),
    "cores": ("os.sched_getaffinity(0)", "{min(get())}", "bind_process(target)"),
}
NEEDS = {"policy": "SCHED_BATCH", "niceness": "setpriority", "cores": "sched_setaffinity"}


@pytest.mark.parametrize("setting", CASES)
def test_every_thread_changes_and_new_ones_inherit(setting):
    if not hasattr(os, NEEDS[setting]):
        pytest.skip(f"no os.{NEEDS[setting]} here")
    get, target, change = CASES[setting]
    script = SCRIPT.format(get=get, target=target, change=change)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_normal_policy_comes_back():
    """Decode workers set it: a policy is inherited from whoever started them."""
    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("no SCHED_BATCH here")
    script = (
        "import os\nfrom worker.sched_policy import set_policy\n"
        "assert set_policy(batch=True) and os.sched_getscheduler(0) == os.SCHED_BATCH\n"
        "assert set_policy(batch=False) and os.sched_getscheduler(0) == os.SCHED_OTHER\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
