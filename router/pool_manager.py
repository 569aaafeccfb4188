"""Creates and stops the worker actors of a pool through Ray."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import ray

from block_index import IndexSettings
from protocol.workers import WorkerInfo
from router import health
from router.config import ServeConfig, WorkerResources
from worker.cpu_binding import CoreAssignment, CoreLayout

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerHandle:
    name: str
    role: str  # "prefill" | "decode" | "colocated"
    actor: Any
    info: WorkerInfo | None = None  # what the worker's start() returned
    in_flight: int = 0


def gpus_per_worker(resources: WorkerResources) -> float:
    """The configured GPUs, or one each where the cluster has any."""
    if resources.num_gpus is not None:
        return resources.num_gpus
    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


ACTOR_MAX_CONCURRENCY = 1 << 16


def actor_options(
    resources: WorkerResources, num_gpus: float, max_restarts: int = 0
) -> dict[str, Any]:
    """Ray actor options of one worker: what it reserves, where it may run
    (custom resources and node labels pin a pool to a node type), and how often
    Ray restarts it when it dies."""
    options: dict[str, Any] = {
        "num_cpus": resources.num_cpus,
        "num_gpus": num_gpus,
        "resources": resources.resources or None,
        "max_restarts": max_restarts,
        "name": None,
        # Calls wait inside a worker (a prefill for its turn, a decode's start
        # for its KV): Ray's default of 1000 at once would let waiting calls
        # hold back health checks and aborts under a long queue.
        "max_concurrency": ACTOR_MAX_CONCURRENCY,
    }
    if resources.labels:
        options["label_selector"] = dict(resources.labels)
    return options


class WorkerPool:
    """Workers of one role. The actor classes are plain classes made remote here."""

    _ids = itertools.count()

    def __init__(
        self,
        role: str,
        config: ServeConfig,
        host: str | None = None,
        cores: CoreLayout | None = None,
    ) -> None:
        """``cores``: this machine's core layout, which the workers bind to
        (worker/cpu_binding.py, CoreAssignment); None binds nothing."""
        self.role = role
        self.config = config
        self.host = host
        self.cores = None if cores is None else CoreAssignment(cores, role)
        self.workers: list[WorkerHandle] = []
        self.resources = config.pools.resources_of(role)
        # The Ray actor class of the workers this pool creates; None: the role's
        # own (actor_class). Set a subclass of it before the pool starts workers
        # to run that instead (benchkit/deployment.py's actor_classes).
        self.actor_cls: type | None = None

    def actor_class(self) -> type:
        """``actor_cls``, else PrefillActor for prefill workers and DecodeActor
        for decode and colocated ones."""
        if self.actor_cls is not None:
            return self.actor_cls
        if self.role == "prefill":
            from prefill_pool.actor import PrefillActor

            return PrefillActor
        from decode_pool.actor import DecodeActor

        return DecodeActor

    async def scale_to(self, n: int, timeout_s: float | None = None) -> list[WorkerHandle]:
        """Add workers until there are ``n``; returns the new ones, started.
        If they do not all start (within ``timeout_s``: Ray may find no node
        with the pool's resources), none is added and the new actors are killed."""
        new: list[WorkerHandle] = []
        try:
            for _ in range(n - len(self.workers)):
                new.append(self._create())
            infos = await asyncio.wait_for(
                asyncio.gather(*(w.actor.start.remote() for w in new)), timeout_s
            )
        except BaseException:
            for worker in new:
                ray.kill(worker.actor)
            self.release_cores(new)
            raise
        for worker, info in zip(new, infos, strict=True):
            worker.info = info
        self.workers += new
        return new

    def take_out(self, n: int) -> list[WorkerHandle]:
        """Remove ``n`` workers from routing (the least loaded, newest first);
        the caller drains and stops them."""
        if not 0 <= n <= len(self.workers):
            raise ValueError(f"cannot remove {n} of {len(self.workers)} {self.role} workers")
        order = sorted(reversed(self.workers), key=lambda w: w.in_flight)
        gone = order[:n]
        self.workers = [w for w in self.workers if w not in gone]
        self.release_cores(gone)
        return gone

    async def find_dead(self, timeout_s: float) -> list[WorkerHandle]:
        """Workers whose actor has died for good (its process or its node is
        gone). A worker that does not answer within ``timeout_s`` counts as
        alive: Ray reports a lost node as a died actor once it notices."""
        states = await asyncio.gather(*(health.check(w, timeout_s) for w in self.workers))
        return [w for w, s in zip(self.workers, states, strict=True) if s is health.Health.DEAD]

    def remove(self, workers: list[WorkerHandle]) -> None:
        """Take ``workers`` out of routing (they are gone already)."""
        self.workers = [w for w in self.workers if w not in workers]
        self.release_cores(workers)

    def release_cores(self, workers: list[WorkerHandle]) -> None:
        """The dedicated cores of ``workers`` (gone, or going) are free again."""
        if self.cores is not None:
            for worker in workers:
                self.cores.release(worker.name)

    async def stop(self) -> None:
        workers, self.workers = self.workers, []
        await asyncio.gather(*(_stop(w) for w in workers))

    @staticmethod
    async def drain(workers: list[WorkerHandle], timeout_s: float) -> None:
        """Wait until the router has nothing in flight on ``workers``, or the timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(w.in_flight for w in workers):
            if asyncio.get_running_loop().time() > deadline:
                log.warning("drain timed out for %s", [w.name for w in workers])
                return
            await asyncio.sleep(0.05)

    @staticmethod
    async def stop_workers(workers: list[WorkerHandle]) -> None:
        await asyncio.gather(*(_stop(w) for w in workers))

    def _create(self) -> WorkerHandle:
        name = f"{self.role}-{next(self._ids)}"
        res = self.resources
        num_gpus = gpus_per_worker(res)
        options = actor_options(res, num_gpus, self.config.pools.worker_max_restarts)
        engine = self.config.engine_config(self.role, num_gpus)
        routing = self.config.routing
        index = IndexSettings(
            redis_url=routing.redis_url,
            redis_password=routing.redis_password_value(),
            deployment=routing.deployment,
        )
        transfer = self.config.transfer_config()
        args = (name, engine, transfer, index, self.host, self.config.server.log_format)
        cores = None if self.cores is None else self.cores.claim(name)
        process = {"cpu_cores": cores, "niceness": self.config.pools.worker_niceness}
        try:
            if self.role == "prefill":
                actor = (
                    ray.remote(self.actor_class())
                    .options(**options)
                    .remote(*args, batch_scheduling=self.config.pools.batch_scheduling, **process)
                )
            else:
                actor = ray.remote(self.actor_class()).options(**options).remote(*args, **process)
        except BaseException:  # no actor: its cores are free again
            if self.cores is not None:
                self.cores.release(name)
            raise
        return WorkerHandle(name, self.role, actor)


async def _stop(worker: WorkerHandle) -> None:
    try:
        await asyncio.wait_for(worker.actor.stop.remote(), timeout=30)
    except Exception as exc:  # a dead worker is stopped already
        log.warning("stopping %s: %s", worker.name, exc)
    ray.kill(worker.actor)
