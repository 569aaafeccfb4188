"""CPU scheduling policy and priority for the processes that share cores with
a decode worker.

Every frame a decode worker's engine thread writes to a router's socket wakes
the router, and Linux treats a socket wakeup as synchronous: it tends to run
the woken task on the waker's core at once, preempting the engine thread
mid-step. The router and the prefill workers are throughput work; under
SCHED_BATCH they still get their share of the CPU but never preempt on
wakeup. Decode workers keep the normal policy (and set it explicitly, since
a policy is inherited from the process that started them). Serving config:
``pools.batch_scheduling``.

A share of the CPU is weighted by the nice value, and Ray starts its
workers at 15: the router at 0 outweighed a decode worker on a shared core
28 to 1. Workers set their own (``pools.worker_niceness``, 0 by default).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)


def each_thread(apply: Callable[[int], object], what: str) -> OSError | None:
    """Call ``apply(tid)`` for every thread of this process (a thread's
    scheduling settings are its own; threads started later inherit their
    creator's). None when it took for at least one thread, else the last
    refusal."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    done, refused = 0, None
    for tid in threads:
        try:
            apply(tid)
            done += 1
        except OSError as exc:  # a thread that just ended, or a refusal
            log.debug("%s of thread %d unchanged: %s", what, tid, exc)
            refused = exc
    return None if done else refused or OSError(f"{what}: no thread")


def set_niceness(value: int) -> bool:
    """Give every thread of this process the nice value ``value``. Ray starts
    its workers at 15, under the router and every other process on the
    machine, so that on a shared core the router's wake-ups took the decode
    worker's CPU; workers set their own. Lowering a nice value needs
    privilege (CAP_SYS_NICE or RLIMIT_NICE): False where it is refused (a
    warning says so)."""
    if not hasattr(os, "setpriority"):
        return False
    refused = each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, value), "nice value")
    if refused is not None:
        kept = os.getpriority(os.PRIO_PROCESS, 0)
        log.warning("nice value %d refused (%s): the worker keeps %d", value, refused, kept)
    return refused is None


def set_policy(batch: bool) -> bool:
    """Put every thread of this process under SCHED_BATCH (``batch``) or the
    normal policy. False where the platform has no such policy or refuses it
    (nothing changes)."""
    policy = getattr(os, "SCHED_BATCH" if batch else "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    param = os.sched_param(0)
    return each_thread(lambda tid: os.sched_setscheduler(tid, policy, param), "policy") is None
