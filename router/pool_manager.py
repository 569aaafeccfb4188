"""Worker handles, the router's pools of them, and creating, starting and
stopping worker actors through Ray (for router/pool_controller.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from block_index import IndexSettings
from protocol.workers import WorkerInfo
from router import health
from router.config import ServeConfig, WorkerResources

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
    """The workers of one role that this router routes to. The deployment
    (router/pool_controller.py) creates and stops them; this is the router's
    own view: which are in routing, and what it has in flight on each."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.workers: list[WorkerHandle] = []
        # The Ray actor class of the workers the deployment creates for this pool;
        # None: the role's own (actor_class). Set a subclass of it before the
        # backend starts to run that instead (benchkit/deployment.py's actor_classes).
        self.actor_cls: type | None = None

    def take_out(self, n: int) -> list[WorkerHandle]:
        """Remove ``n`` workers from routing (the least loaded, newest first);
        the caller drains and stops them."""
        if not 0 <= n <= len(self.workers):
            raise ValueError(f"cannot remove {n} of {len(self.workers)} {self.role} workers")
        order = sorted(reversed(self.workers), key=lambda w: w.in_flight)
        gone = order[:n]
        self.workers = [w for w in self.workers if w not in gone]
        return gone

    async def find_dead(self, timeout_s: float) -> list[WorkerHandle]:
        """Workers whose actor has died for good (its process or its node is
        gone). A worker that does not answer within ``timeout_s`` counts as
        alive: Ray reports a lost node as a died actor once it notices."""
        workers = list(self.workers)  # routing may change while the checks run
        states = await asyncio.gather(*(health.check(w, timeout_s) for w in workers))
        return [w for w, s in zip(workers, states, strict=True) if s is health.Health.DEAD]

    def remove(self, workers: list[WorkerHandle]) -> None:
        """Take ``workers`` out of routing (they are gone, or going)."""
        self.workers = [w for w in self.workers if w not in workers]

    @staticmethod
    async def drain(workers: list[WorkerHandle], timeout_s: float) -> None:
        """Wait until the router has nothing in flight on ``workers``, or the timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(w.in_flight for w in workers):
            if asyncio.get_running_loop().time() > deadline:
                log.warning("drain timed out for %s", [w.name for w in workers])
                return
            await asyncio.sleep(0.05)


def actor_class(role: str, override: type | None = None) -> type:
    """``override``, else PrefillActor for prefill workers and DecodeActor for
    decode and colocated ones."""
    if override is not None:
        return override
    if role == "prefill":
        from prefill_pool.actor import PrefillActor

        return PrefillActor
    from decode_pool.actor import DecodeActor

    return DecodeActor


def create_worker(
    config: ServeConfig,
    role: str,
    name: str,
    cls: type,
    namespace: str | None = None,
    cores: tuple[int, ...] | None = None,
) -> WorkerHandle:
    """A new worker actor (not started). ``namespace``: a detached actor named
    ``name`` in that Ray namespace (a named deployment's worker, which outlives
    the router); None: an actor that dies with its creator. ``cores``: the
    cores its process is bound to."""
    res = config.pools.resources_of(role)
    num_gpus = gpus_per_worker(res)
    options = actor_options(res, num_gpus, config.pools.worker_max_restarts)
    if namespace is not None:
        options.update(name=name, namespace=namespace, lifetime="detached")
    engine = config.engine_config(role, num_gpus)
    routing = config.routing
    index = IndexSettings(
        redis_url=routing.redis_url,
        redis_password=routing.redis_password_value(),
        deployment=config.deployment.redis_name(),
    )
    transfer = config.transfer_config()
    args = (name, engine, transfer, index, None, config.server.log_format)
    process: dict[str, Any] = {"cpu_cores": cores, "niceness": config.pools.worker_niceness}
    if role == "prefill":
        process["batch_scheduling"] = config.pools.batch_scheduling
    if res.tensor_parallel_size > 1:
        options["scheduling_strategy"] = _rank_placement(name, res, num_gpus, namespace)
        options.pop("label_selector", None)  # the bundles carry it
        process["rank_resources"] = {
            "num_cpus": res.num_cpus,
            "num_gpus": num_gpus,
            "resources": res.resources or None,
        }
    actor = ray.remote(cls).options(**options).remote(*args, **process)
    return WorkerHandle(name, role, actor)


def placement_name(worker: str) -> str:
    """The name of the placement group of a tensor-parallel worker's ranks."""
    return f"{worker}-ranks"


def _rank_placement(
    name: str, res: WorkerResources, num_gpus: float, namespace: str | None
) -> PlacementGroupSchedulingStrategy:
    """A placement group of one bundle per rank, all on one node (STRICT_PACK),
    for a tensor-parallel worker; its actor (rank 0) goes in bundle 0 and
    starts the others in the rest (worker/tp_ranks.py). Detached with a
    detached worker; removed by ``release_placement``."""
    bundle = {"CPU": res.num_cpus, **res.resources}
    if num_gpus > 0:
        bundle["GPU"] = num_gpus
    tp = res.tensor_parallel_size
    group = placement_group(
        [dict(bundle) for _ in range(tp)],
        strategy="STRICT_PACK",
        name=placement_name(name),
        lifetime="detached" if namespace is not None else None,
        bundle_label_selector=[dict(res.labels) for _ in range(tp)] if res.labels else None,
    )
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)


def release_placement(worker: str) -> None:
    """Remove the placement group of a tensor-parallel worker that is gone for
    good (nothing for another worker); the ranks in it end with it. Without a
    Ray connection there is no group to remove (and none is started here)."""
    if not ray.is_initialized():
        return
    wanted = placement_name(worker)
    for group_id, info in ray.util.placement_group_table().items():
        if info.get("name") == wanted and info.get("state") != "REMOVED":
            group = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id)))
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)


def kill_worker(worker: WorkerHandle) -> None:
    """Kill a worker's actor for good and free its ranks' placement."""
    with contextlib.suppress(Exception):
        ray.kill(worker.actor)
    release_placement(worker.name)


async def start_workers(workers: list[WorkerHandle], timeout_s: float | None) -> None:
    """Start new workers (their models load); each one's ``info`` is set. On an
    error or past ``timeout_s`` every one of them is killed and it raises."""
    try:
        infos = await asyncio.wait_for(
            asyncio.gather(*(w.actor.start.remote() for w in workers)), timeout_s
        )
    except BaseException:
        for worker in workers:
            kill_worker(worker)
        raise
    for worker, info in zip(workers, infos, strict=True):
        worker.info = info


async def stop_workers(workers: list[WorkerHandle]) -> None:
    await asyncio.gather(*(_stop(w) for w in workers))


async def _stop(worker: WorkerHandle) -> None:
    try:
        await asyncio.wait_for(worker.actor.stop.remote(), timeout=30)
    except Exception as exc:  # a dead worker is stopped already
        log.warning("stopping %s: %s", worker.name, exc)
    kill_worker(worker)
