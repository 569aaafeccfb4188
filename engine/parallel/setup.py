"""Rank 0's side of tensor parallelism: starting the other ranks, joining
them, and stopping them (engine/parallel/__init__.py has the design)."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from engine.kv_cache import KVCache
from engine.parallel import auth
from engine.parallel.group import GroupBroken, RankGroup, Rendezvous, rank_error, wait_ready
from engine.parallel.kv import ShardedKV
from engine.parallel.rank import RankSpec, ShardPlan, load_shard
from engine.parallel.steps import ShardedModel

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 3600.0  # ranks load their share; a rank that fails says so at once
STOP_TIMEOUT_S = 30.0


class RankLauncher(Protocol):
    """Starts ranks 1..N-1, each running engine.parallel.rank.run_rank(spec)."""

    def device(self, rank: int, device_type: str) -> str:
        """The torch device rank ``rank`` uses, as its own process names it."""
        ...

    def launch(self, specs: list[RankSpec]) -> None: ...

    def lost(self) -> str | None:
        """A rank that has ended, and how; None while all run."""
        ...

    def close(self, timeout_s: float) -> None:
        """Wait for the ranks to end (they were told to stop), then end the rest."""
        ...


class TensorParallel:
    """Rank 0's handle on the ranks of its engine."""

    def __init__(
        self,
        group: RankGroup,
        model: ShardedModel,
        launcher: RankLauncher,
    ) -> None:
        self.group = group
        self.model = model
        self.launcher = launcher
        self.kv: ShardedKV | None = None  # once the engine's cache exists
        self.closing = False  # close() has begun: ranks that end now were told to

    @property
    def size(self) -> int:
        return self.group.size

    def attach(self, cache: KVCache) -> None:
        """Rank 0's own cache: the kv reads and writes go through it and the others'."""
        self.kv = ShardedKV(self.group, cache)

    def close(self, stepping: bool = False) -> None:
        """Stop the other ranks and wait for them (safe to call more than once).
        Those of a broken group are not told (nothing reaches them in step) nor
        waited for: a hung one would never end by itself; they are ended.
        ``stepping``: the engine thread may still be in a pass on the steps
        group, which no second thread may use at the same time: the group is
        broken first (ending the ranks ends that pass too)."""
        self.closing = True
        if stepping:
            self.group.fail("closed while the engine thread was still in a pass")
        told = self.group.broken is None
        try:
            self.model.stop()
            if self.kv is not None:
                self.kv.stop()
        except GroupBroken as exc:
            told = False
            log.warning("tensor-parallel ranks not stopped cleanly: %s", exc)
        self.group.fail("closed")
        self.launcher.close(STOP_TIMEOUT_S if told else 0)


def start(
    plan: ShardPlan, device: torch.device, launcher: RankLauncher | None = None
) -> TensorParallel:
    """Start ranks 1..N-1 (``launcher``, default local processes), load rank
    0's share here, and join them."""
    if launcher is None:
        from engine.parallel.local import LocalRanks

        launcher = LocalRanks()
    tp = plan.config.tensor_parallel_size
    rendezvous = Rendezvous.new(tp, "nccl" if device.type == "cuda" else "gloo")
    store = rendezvous.store()
    secret = auth.new_secret()  # to the ranks in their specs, never through the store
    try:
        specs = [
            RankSpec(plan, rendezvous, r, launcher.device(r, device.type), secret)
            for r in range(1, tp)
        ]
        launcher.launch(specs)
        local = load_shard(plan, 0, device)
        wait_ready(store, tp, launcher.lost, READY_TIMEOUT_S)
        group = _join(rendezvous, store, device, secret)
    except BaseException:
        launcher.close(0)
        raise
    finally:
        rendezvous.remove()  # joined (or failed): nothing reads the store again
    local.reduce = group.all_reduce
    return TensorParallel(group, ShardedModel(local, group, plan.vocab_size), launcher)


def _join(rendezvous: Rendezvous, store, device: torch.device, secret: bytes) -> RankGroup:
    """Rank 0's end of the groups. When another rank failed first (its proof of
    a peer, most likely), its own error says more than the broken connection
    that rank 0 saw."""
    try:
        return RankGroup(rendezvous, 0, store, device, secret)
    except auth.PeerRefused:
        raise
    except RuntimeError as exc:  # GroupBroken included
        error = rank_error(store, rendezvous.world_size)
        if error is None:
            raise
        raise RuntimeError(error) from exc
