"""The one health check of a worker, for every caller: a request that waits
on a silent worker (router/watchdog.py), recovery of a worker out of routing
(router/worker_recovery.py) and the search for dead actors to replace
(router/pool_manager.py).

The answer comes from the worker's engine thread (worker/base.py
``health``), so a stuck engine fails the check like a dead process, and a
worker whose engine steps keep failing (``WorkerHealth.failing``) fails it
too: it stays out of routing until it passes, as a hung one would.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING

import ray.exceptions

if TYPE_CHECKING:
    from router.pool_manager import WorkerHandle


class Health(enum.Enum):
    HEALTHY = "healthy"  # started, the incarnation the router knows
    RESTARTED = "restarted"  # Ray restarted the actor: it lost its state (not started yet)
    STALE = "stale"  # started, but not the incarnation the router knows
    FAILING = "failing"  # the incarnation the router knows, but its steps keep failing
    SILENT = "silent"  # no answer in time: hung, or still restarting
    DEAD = "dead"  # Ray says the actor died for good: no restart will come


async def check(worker: WorkerHandle, timeout_s: float) -> Health:
    try:
        health = await asyncio.wait_for(worker.actor.health.remote(), timeout_s)
    except ray.exceptions.ActorDiedError:
        return Health.DEAD
    except Exception:  # a timeout, an actor restarting or unreachable
        return Health.SILENT
    if not health.started:
        return Health.RESTARTED
    known = worker.info.incarnation if worker.info is not None else None
    if health.incarnation != known:
        return Health.STALE
    return Health.FAILING if health.failing else Health.HEALTHY
