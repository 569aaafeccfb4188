"""The other ranks of a tensor-parallel worker, as Ray actors.

The worker's actor is rank 0 (it runs the engine, engine/parallel/). It
starts ranks 1..N-1 as actors it owns, each in a bundle of the placement
group the deployment created for the worker (router/pool_manager.py: N
bundles of the pool's resources, STRICT_PACK, so every rank is on rank 0's
machine), or, for a worker created outside one, pinned to rank 0's node.
The ranks die with rank 0's process (Ray ends the actors a dead owner
held); rank 0's process ends when a rank is lost or the ranks fell out of
step (``watch``), so that Ray restarts the worker whole, ranks included.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from engine.parallel.rank import RankSpec
from engine.parallel.setup import TensorParallel
from worker.logfmt import LogFormat, configure_logging
from worker.sched_policy import set_niceness, set_policy

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 1.0


class RankActor:
    """One rank (1..N-1) of a tensor-parallel worker."""

    def __init__(self, log_format: LogFormat, batch_scheduling: bool, niceness: int | None) -> None:
        configure_logging(log_format)
        set_policy(batch_scheduling)
        if niceness is not None:
            set_niceness(niceness)

    def run(self, spec: RankSpec) -> None:
        """Load this rank's share and run rank 0's passes until it stops them."""
        from engine.parallel.rank import run_rank

        run_rank(spec)

    def pid(self) -> int:
        return os.getpid()


class RayRanks:
    """engine.parallel.setup.RankLauncher over Ray actors."""

    def __init__(
        self,
        resources: dict[str, Any],
        log_format: LogFormat = "text",
        batch_scheduling: bool = False,
        niceness: int | None = None,
    ) -> None:
        """``resources``: each rank's Ray options (num_cpus, num_gpus,
        resources), those of the worker's own actor."""
        self.resources = resources
        self.process = (log_format, batch_scheduling, niceness)
        self.actors: dict[int, Any] = {}
        self._runs: dict[int, Any] = {}

    def device(self, rank: int, device_type: str) -> str:
        return "cuda:0" if device_type == "cuda" else "cpu"  # Ray gives each its own GPU

    def launch(self, specs: list[RankSpec]) -> None:
        pg = get_current_placement_group()
        for spec in specs:
            if pg is not None:
                where = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.rank)
            else:  # a worker created without a placement group: its ranks on its node
                node = ray.get_runtime_context().get_node_id()
                where = NodeAffinitySchedulingStrategy(node, soft=False)
            actor = (
                ray.remote(RankActor)
                .options(**self.resources, scheduling_strategy=where, max_concurrency=2)
                .remote(*self.process)
            )
            self.actors[spec.rank] = actor
            self._runs[spec.rank] = actor.run.remote(spec)

    def lost(self) -> str | None:
        ended, _ = ray.wait(list(self._runs.values()), timeout=0)
        for rank, ref in self._runs.items():
            if ref in ended:
                try:
                    ray.get(ref)
                except Exception as exc:
                    return f"rank {rank} failed: {str(exc).splitlines()[0][:300]}"
                return f"rank {rank} ended"
        return None

    def close(self, timeout_s: float) -> None:
        runs = list(self._runs.values())
        if runs and timeout_s > 0:
            ray.wait(runs, num_returns=len(runs), timeout=timeout_s)
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        self._runs.clear()


def watch(tp: TensorParallel, ranks: RayRanks) -> threading.Thread:
    """End this process (Ray restarts the worker, ranks and all) once a rank
    is lost or the group broke, unless the engine is closing them."""

    def run() -> None:
        while not tp.closing:
            why = ranks.lost() or tp.group.broken
            if why is not None and not tp.closing:
                log.error("tensor-parallel worker: %s; ending this process", why)
                logging.shutdown()
                os._exit(1)
            threading.Event().wait(WATCH_INTERVAL_S)

    thread = threading.Thread(target=run, name="tp-watch", daemon=True)
    thread.start()
    return thread
