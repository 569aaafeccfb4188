"""Leases: blocks held for a transfer are released if nobody renews them.

A lease is renewed on every message of its transfer, so it measures time
without progress, not total time: a 1 GiB transfer never expires while
bytes flow, and a dead peer or an abandoned transfer frees its blocks after
``ttl_s``. The owner of the lease releases the blocks itself on the normal
paths and cancels the lease; ``on_expire`` runs only if that never happens.

The blocks themselves are held in the pool by a "lease" holder per
transfer (``lease_holder``, a ``LeaseHolder``: the transfer's role and
request id as fields), whatever the timer does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from engine.block_pool import Holder

_transfer_ids = itertools.count()

TransferRole = Literal["send", "recv"]


@dataclass(frozen=True, slots=True)
class LeaseHolder(Holder):
    """The holder of one transfer's blocks; its ``id`` ("<role>:<request
    id>#<n>") is unique to the transfer, the fields say what it is for."""

    role: TransferRole
    request_id: str


def lease_holder(role: TransferRole, request_id: str) -> LeaseHolder:
    """A new holder for the blocks of one transfer: ``role`` ("send" or
    "recv"), the request it is for, and a number no other transfer has."""
    return LeaseHolder("lease", f"{role}:{request_id}#{next(_transfer_ids)}", role, request_id)


class Lease:
    def __init__(self, table: LeaseTable, key: int, ttl_s: float, on_expire: Callable[[], None]):
        self._table = table
        self.key = key
        self.ttl_s = ttl_s
        self.on_expire = on_expire
        self.deadline = table.clock() + ttl_s

    def renew(self) -> None:
        self.deadline = self._table.clock() + self.ttl_s

    def cancel(self) -> None:
        self._table._leases.pop(self.key, None)

    @property
    def active(self) -> bool:
        return self.key in self._table._leases


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[int, Lease] = {}
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, ttl_s: float, on_expire: Callable[[], None]) -> Lease:
        lease = Lease(self, next(self._keys), ttl_s, on_expire)
        self._leases[lease.key] = lease
        return lease

    def expire_due(self, now: float | None = None) -> int:
        """Run ``on_expire`` of every lease past its deadline; their count."""
        now = self.clock() if now is None else now
        due = [lease for lease in self._leases.values() if lease.deadline <= now]
        for lease in due:
            lease.cancel()
            lease.on_expire()
        return len(due)

    def expire_all(self) -> int:
        return self.expire_due(float("inf"))
