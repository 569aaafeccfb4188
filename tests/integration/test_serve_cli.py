"""`tandem serve` as a user runs it: a subprocess that starts its own Ray on
loopback, answers `tandem generate` without loading torch in the router's
process, and on SIGTERM drains and leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker.cpu_binding import available_cores, plan_layout

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 180.0


def _descendants(pid: int) -> set[int]:
    """Every live descendant of pid (Linux /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_line(proc: subprocess.Popen, pattern: str) -> str:
    deadline = time.monotonic() + STARTUP_S
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if re.search(pattern, line):
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no line matching {pattern!r}; exit code {proc.poll()}")


def _worker_pids(tree: set[int]) -> dict[str, int]:
    roles = {}
    for pid in tree:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        for role in ("PrefillActor", "DecodeActor"):
            if f"ray::{role}" in cmdline:
                roles[role] = pid
    assert set(roles) == {"PrefillActor", "DecodeActor"}, roles
    return roles


def _assert_scheduling(router: int, roles: dict[str, int]) -> None:
    """batch_scheduling (on by default): the router and the prefill worker run
    under SCHED_BATCH, the decode worker under the normal policy."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    assert os.sched_getscheduler(router) == os.SCHED_BATCH
    assert os.sched_getscheduler(roles["PrefillActor"]) == os.SCHED_BATCH
    assert os.sched_getscheduler(roles["DecodeActor"]) == os.SCHED_OTHER
    # worker_niceness (0 by default), not Ray's 15 under the router's 0.
    assert os.getpriority(os.PRIO_PROCESS, roles["DecodeActor"]) == 0
    assert os.getpriority(os.PRIO_PROCESS, roles["PrefillActor"]) == 0


def _assert_binding(router: int, roles: dict[str, int]) -> None:
    """cpu_binding (auto by default): where this machine has a core to spare,
    the decode worker runs on a core of its own and the router and the
    prefill worker on the others; otherwise nothing is bound."""
    if not hasattr(os, "sched_getaffinity"):
        return
    layout = plan_layout(available_cores(), decode_workers=1, threads=1)
    decode = set(layout.decode[0]) if layout else set(available_cores())
    shared = set(layout.shared) if layout else set(available_cores())
    assert os.sched_getaffinity(roles["DecodeActor"]) == decode
    assert os.sched_getaffinity(roles["PrefillActor"]) == shared
    assert os.sched_getaffinity(router) == shared


def _maps_torch(pid: int) -> bool:
    """Whether the process has libtorch mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_serve_generate_then_sigterm_leaves_nothing_behind():
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "tandem_cli.main", "serve", "--port", "0", "--grace-period", "10"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = _wait_line(proc, r"tandem: serving .* on 127\.0\.0\.1:\d+")
        address = re.search(r"on (127\.0\.0\.1:\d+)", line).group(1)
        tree = _descendants(proc.pid)
        assert tree, "Ray should run in child processes"
        gen_args = ["def f(x):", "--target", address, "--max-tokens", "4", "--timeout", "60"]
        gen = subprocess.run(
            [sys.executable, "-m", "tandem_cli.main", "generate", *gen_args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        assert "4 completion tokens" in gen.stderr
        roles = _worker_pids(tree)
        # The router tokenized the prompt and streamed the tokens without the
        # model code; the workers run it.
        assert not _maps_torch(proc.pid)
        assert _maps_torch(roles["DecodeActor"])
        _assert_scheduling(proc.pid, roles)
        _assert_binding(proc.pid, roles)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        deadline = time.monotonic() + 30
        while (left := {p for p in tree if _alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
