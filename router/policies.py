"""Routing policies: which worker of a pool gets the next request."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from router.pool_manager import WorkerHandle


class RoutingPolicy(Protocol):
    def pick(self, workers: Sequence[WorkerHandle]) -> WorkerHandle: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[WorkerHandle]) -> WorkerHandle:
        if not workers:
            raise LookupError("no worker is available")
        return workers[next(self._counter) % len(workers)]


class LeastLoaded:
    """Fewest requests in flight; ties go round robin so load spreads."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: Sequence[WorkerHandle]) -> WorkerHandle:
        if not workers:
            raise LookupError("no worker is available")
        least = min(w.in_flight for w in workers)
        tied = [w for w in workers if w.in_flight == least]
        return tied[next(self._counter) % len(tied)]


POLICIES: dict[str, type[RoutingPolicy]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}


def make_policy(name: str) -> RoutingPolicy:
    """The policy ``name``, one of POLICIES (routing.policy checks the name)."""
    return POLICIES[name]()
