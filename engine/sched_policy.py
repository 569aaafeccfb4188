"""CPU scheduling policy for the processes that share cores with a decode worker.

Every frame a decode worker's engine thread writes to a router's socket wakes
the router, and Linux treats a socket wakeup as synchronous: it tends to run
the woken task on the waker's core at once, preempting the engine thread
mid-step. The router and the prefill workers are throughput work; under
SCHED_BATCH they still get their share of the CPU but never preempt on
wakeup. Decode workers keep the normal policy (and set it explicitly, since
a policy is inherited from the process that started them). Serving config:
``batch_scheduling``.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def set_policy(batch: bool) -> bool:
    """Put every thread of this process under SCHED_BATCH (``batch``) or the
    normal policy; threads started later inherit it from their creator. False
    where the platform has no such policy or refuses it (nothing changes)."""
    policy = getattr(os, "SCHED_BATCH" if batch else "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return False
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    done = 0
    for tid in threads:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done += 1
        except OSError as exc:  # a thread that just ended, or a refusal
            log.debug("scheduling policy of thread %d unchanged: %s", tid, exc)
    return done > 0
