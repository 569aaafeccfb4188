"""What every worker's Ray actor does, around a worker built in its process.

Torch-free at import: the router imports the actor classes to create them,
and only the actor's own process builds the worker (and loads the model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from protocol.workers import CachedBlocks, WorkerHealth, WorkerInfo, WorkerStats
from worker.cpu_binding import bind_process
from worker.heap import freeze_startup_heap
from worker.logfmt import LogFormat, configure_logging
from worker.sched_policy import set_niceness, set_policy

if TYPE_CHECKING:
    from block_index import IndexSettings
    from engine.config import EngineConfig
    from kv_transfer import TransferConfig
    from worker.tp_ranks import RayRanks


class WorkerActor:
    """What every worker's Ray actor does; the pool manager makes a subclass
    remote with ``ray.remote(...).options(resources)``. Subclasses build
    their worker in ``make_worker`` (importing it there) and add their
    role's calls."""

    def __init__(
        self,
        name: str,
        config: EngineConfig,
        transfer: TransferConfig,
        index: IndexSettings,
        host: str | None,
        log_format: LogFormat = "text",
        batch_scheduling: bool = False,
        cpu_cores: tuple[int, ...] | None = None,
        niceness: int | None = None,
        rank_resources: dict[str, Any] | None = None,
    ) -> None:
        """``batch_scheduling``: this process runs under SCHED_BATCH (prefill
        workers, see worker/sched_policy.py); otherwise under the normal policy.
        ``cpu_cores``: the cores this process is bound to (worker/cpu_binding.py),
        before the engine starts its threads; None: as inherited. ``niceness``:
        this process's nice value (sched_policy.set_niceness); None: Ray's.
        ``rank_resources``: the Ray options (num_cpus, num_gpus, resources) of
        each other rank of a tensor-parallel worker (worker/tp_ranks.py), as
        this actor's own."""
        configure_logging(log_format)  # this actor's process: structured request events
        set_policy(batch_scheduling)
        if niceness is not None:
            set_niceness(niceness)
        if cpu_cores is not None:
            bind_process(cpu_cores)
        if host is None:  # the address Ray gives this node, so peers on other nodes reach it
            import ray

            host = ray.util.get_node_ip_address()
        ranks: RayRanks | None = None
        options: dict[str, Any] = {}
        if config.tensor_parallel_size > 1:
            from worker.tp_ranks import RayRanks

            ranks = RayRanks(rank_resources or {}, log_format, batch_scheduling, niceness)
            options["ranks"] = ranks
        self.worker = self.make_worker(name, config, transfer, index, host, **options)
        if ranks is not None:
            from worker.tp_ranks import watch

            watch(self.worker.engine.tp, ranks)
        self._ranks = ranks
        self._starting: asyncio.Future | None = None
        freeze_startup_heap()  # this process serves this one worker until it exits

    @staticmethod
    def make_worker(
        name: str,
        config: EngineConfig,
        transfer: TransferConfig,
        index: IndexSettings,
        host: str,
        **options: Any,
    ) -> Any:
        """The worker; ``options``: ``ranks``, the launcher of a tensor-parallel
        worker's other ranks (only given when tensor_parallel_size > 1)."""
        raise NotImplementedError

    async def start(self) -> WorkerInfo:
        """Start the worker (once: a worker started already just describes
        itself, so routers of a shared deployment may all call it)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self.worker.start())
        await asyncio.shield(self._starting)
        return self.worker.describe()

    async def info(self) -> WorkerInfo:
        """What ``start`` returned, without starting anything (a router
        attaching to running workers asks it); ``started`` says whether
        ``start`` has finished."""
        done = self._starting is not None and self._starting.done()
        started = done and not self._starting.cancelled() and self._starting.exception() is None
        return dataclasses.replace(self.worker.describe(), started=started)

    async def abort(self, request_id: str) -> bool:
        return await self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        return self.worker.stats()

    async def health(self) -> WorkerHealth:
        return await self.worker.health()

    async def cached_blocks(self) -> CachedBlocks:
        """The hashes of the blocks in the worker's prefix cache now."""
        return CachedBlocks(self.worker.name, tuple(await self.worker.cached_blocks()))

    async def pid(self) -> int:
        """The actor's process id (chaos tests kill it)."""
        return os.getpid()

    async def rank_pids(self) -> list[int]:
        """The process ids of a tensor-parallel worker's other ranks (none at size 1)."""
        if self._ranks is None:
            return []
        return list(await asyncio.gather(*(a.pid.remote() for a in self._ranks.actors.values())))

    async def stop(self) -> None:
        await self.worker.stop()
