"""Which router decides: the deployment's owner (router/deployment.py) keeps
a lease. Every autoscaling router reports its load each round
(``turn``); the router holding the lease decides, on every live router's
load added up. A leader that stops reporting for ``lease_s`` (it stopped,
or its process hangs) loses the lease to the next router that reports.

Each report also carries the router's requests in flight per worker (every
member it knows, in routing or not): a retiring worker stops only once every
live router has reported none on it (``routed``).
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
        self._in_flight: dict[str, dict[str, int]] = {}  # by router: its tries per worker
        self._lease_s = 0.0

    def turn(
        self, router_id: str, load: Load, lease_s: float, in_flight: dict[str, int] | None = None
    ) -> Turn:
        """``in_flight``: the router's requests in flight per worker (those with none left out)."""
        now = self.clock()
        self._lease_s = lease_s
        self._reports[router_id] = (now, load)
        self._in_flight[router_id] = dict(in_flight or {})
        self._reports = {r: v for r, v in self._reports.items() if now - v[0] <= lease_s}
        self._in_flight = {r: v for r, v in self._in_flight.items() if r in self._reports}
        if self.leader not in self._reports:
            self.leader = router_id
        loads = tuple(load for _, load in self._reports.values())
        return Turn(self.leader == router_id, loads)

    def routed(self, worker: str, since: float) -> int | None:
        """Requests every live router has in flight on ``worker`` by its latest
        report; None while a live router has not reported since ``since``
        (this clock), or no router is live."""
        now = self.clock()
        live = [r for r, (t, _) in self._reports.items() if now - t <= self._lease_s]
        if not live or any(self._reports[r][0] < since for r in live):
            return None
        return sum(self._in_flight.get(r, {}).get(worker, 0) for r in live)

    def leave(self, router_id: str) -> None:
        """A router stopped: the next report takes the lease at once."""
        self._reports.pop(router_id, None)
        self._in_flight.pop(router_id, None)
        if self.leader == router_id:
            self.leader = None
