"""Stopping and killing worker processes mid-stream, for the failover tests
(test_chaos.py, test_deterministic_serving.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import ray

from router.pool_manager import WorkerHandle


def freeze(worker: WorkerHandle) -> int:
    """Stop the worker's process (SIGSTOP); its requests stay where they are."""
    pid = ray.get(worker.actor.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    return pid


def kill(worker: WorkerHandle, pid: int, how: str) -> None:
    """Kill a frozen worker: ray.kill (Ray restarts it) or SIGKILL of its process."""
    if how == "ray.kill":
        ray.kill(worker.actor, no_restart=False)
        os.kill(pid, signal.SIGCONT)  # it takes the kill request and exits
    else:
        os.kill(pid, signal.SIGKILL)


def stop_midway(workers: list[WorkerHandle], streams, counts: dict[str, int], max_tokens: int):
    """Stop (SIGSTOP) the decode worker of a stream that has tokens and is not
    finished (of ``max_tokens``), and return (worker, pid); None (nothing
    stopped) if there is no such stream. Every decode worker is stopped while
    one is chosen, so no stream can finish in between. ``streams``: the
    backend's output streams; ``counts``: tokens received by request id."""
    pids = {w.name: ray.get(w.actor.pid.remote(), timeout=30) for w in workers}
    victim = None
    try:
        for pid in pids.values():
            os.kill(pid, signal.SIGSTOP)
        _until_quiet(counts)  # tokens sent before the stop reach the client
        midway = [
            (n, worker)
            for attempt, worker in streams.routed().items()
            if 0 < (n := counts.get(attempt.split("#", 1)[0], 0)) < max_tokens
            and worker.name in pids
        ]
        victim = min(midway, key=lambda x: x[0])[1] if midway else None  # furthest from its end
    finally:  # whatever happens, only the victim stays stopped
        for name, pid in pids.items():
            if victim is None or name != victim.name:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    return None if victim is None else (victim, pids[victim.name])


def _until_quiet(counts: dict[str, int], quiet_s: float = 0.3, timeout_s: float = 30.0) -> None:
    """Until the tokens received have not changed for ``quiet_s`` (however late
    the client runs), or ``timeout_s``."""
    last, since = dict(counts), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = dict(counts)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
