"""Cores of their own for CPU decode workers on one machine.

A decode worker's step time is the time per output token its users see.
Each step's output wakes the router, and Linux treats a socket wake-up as
synchronous: it tends to run the woken task on the waker's core, so the
router (and, on a benchmark box, the client) lands on the decode worker's
core and the step waits for it. SCHED_BATCH (sched_policy.py) stops the
preemption but not the sharing. Binding each decode (or colocated) worker's
process to cores of its own, and the router, Ray's daemons and the prefill
workers to the cores left over, keeps the decode cores for decode steps.

The layout is planned once, by the process that starts the local Ray
cluster (``tandem serve``), before anything else starts: its own threads
and every process Ray starts inherit the shared cores, and each decode
worker binds itself to its set when its actor starts. Serving config:
``pools.cpu_binding``.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from worker.sched_policy import each_thread

Cores = tuple[int, ...]


@dataclass(frozen=True)
class CoreLayout:
    """Which cores run what on this machine."""

    shared: Cores  # the router, Ray's daemons, prefill workers, clients of a benchmark
    decode: tuple[Cores, ...]  # one set per decode (or colocated) worker
    machine: Cores  # every core this process may use; a decode worker beyond the plan's

    def describe(self) -> str:
        sets = ", ".join(_span(c) for c in self.decode)
        return f"decode workers on {sets}; router, Ray and prefill on {_span(self.shared)}"


def available_cores() -> Cores:
    """The cores this process may run on (a container's or taskset's limit included)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def plan_layout(cores: Collection[int], decode_workers: int, threads: int) -> CoreLayout | None:
    """Give each of ``decode_workers`` workers ``threads`` cores of its own (the
    highest-numbered ones) and leave the rest shared; None when that would
    leave no core shared (nothing is bound then)."""
    ordered = sorted(cores)
    dedicated = decode_workers * threads
    if decode_workers < 1 or threads < 1 or dedicated >= len(ordered):
        return None
    first = len(ordered) - dedicated
    sets = tuple(
        tuple(ordered[first + i * threads : first + (i + 1) * threads])
        for i in range(decode_workers)
    )
    return CoreLayout(tuple(ordered[:first]), sets, tuple(ordered))


def bind_process(cores: Collection[int]) -> bool:
    """Bind every thread of this process to ``cores``; threads started later
    inherit it from their creator. False where the platform cannot (nothing
    changes) or refuses."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    wanted = set(cores)
    return each_thread(lambda tid: os.sched_setaffinity(tid, wanted), "affinity") is None


class CoreAssignment:
    """One pool's share of a layout: prefill workers get the shared cores;
    decode (and colocated) workers a set of their own each while one is free,
    then every core (never only the shared ones, which the router crowds)."""

    def __init__(self, layout: CoreLayout, role: str) -> None:
        self.layout = layout
        self.role = role
        self._owners: dict[Cores, str] = {}  # decode sets in use -> worker name

    def claim(self, worker: str) -> Cores:
        if self.role == "prefill":
            return self.layout.shared
        free = next((c for c in self.layout.decode if c not in self._owners), None)
        if free is None:
            return self.layout.machine
        self._owners[free] = worker
        return free

    def release(self, worker: str) -> None:
        """``worker`` is gone (or going): its set is free for the next one."""
        self._owners = {c: w for c, w in self._owners.items() if w != worker}


def _span(cores: Cores) -> str:
    if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1:
        return f"cores {cores[0]}-{cores[-1]}"
    return ("core " if len(cores) == 1 else "cores ") + ",".join(map(str, cores))


def nvidia_gpus_visible() -> bool:
    """Whether this machine shows this process an NVIDIA GPU (the driver's
    device list, less CUDA_VISIBLE_DEVICES hiding them all), without loading
    torch or CUDA: the router process asks before it starts Ray."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(Path("/proc/driver/nvidia/gpus").glob("*")) or Path("/dev/nvidia0").exists()
