"""Which router decides: the deployment's owner (router/deployment.py) keeps
a lease. Every autoscaling router reports its load each round
(``turn``); the router holding the lease decides, on every live router's
load added up. A leader that stops reporting for ``lease_s`` (it stopped,
or its process hangs) loses the lease to the next router that reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from router.autoscaler_observe import Load


@dataclass(frozen=True)
class Turn:
    """A router's answer: whether it decides this round, and every live router's load."""

    leader: bool
    loads: tuple[Load, ...]


class LeaderLease:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.leader: str | None = None
        self._reports: dict[str, tuple[float, Load]] = {}

    def turn(self, router_id: str, load: Load, lease_s: float) -> Turn:
        now = self.clock()
        self._reports[router_id] = (now, load)
        self._reports = {r: v for r, v in self._reports.items() if now - v[0] <= lease_s}
        if self.leader not in self._reports:
            self.leader = router_id
        loads = tuple(load for _, load in self._reports.values())
        return Turn(self.leader == router_id, loads)

    def leave(self, router_id: str) -> None:
        """A router stopped: the next report takes the lease at once."""
        self._reports.pop(router_id, None)
        if self.leader == router_id:
            self.leader = None
