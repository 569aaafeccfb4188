"""Fault injection for chaos tests: make a worker's next pushes fail in a
chosen way, through the gRPC client's message filter.

A filter sees every outgoing push message (the header first, then each chunk,
or each data-channel frame with its payload, then the commit). ``corrupt``
flips the last byte of the first chunk, so the receiver's checksum check
fails (DATA_LOSS); ``stall`` holds the first chunk back for ``stall_s``, so
the push's deadline passes before it is sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MessageFilter = Callable[[bytes], bytes | None]


@dataclass(frozen=True)
class TransferFaults:
    """Faults for a worker's next pushes (each push takes at most one)."""

    corrupt_pushes: int = 0
    """The next this many pushes have a byte of their first chunk flipped."""
    stall_pushes: int = 0
    """Then the next this many pushes stall before their first chunk."""
    stall_s: float = 0.0
    """How long a stalled push waits (longer than the transfer deadline)."""


class FaultPlan:
    """What is left of a ``TransferFaults``; hands each push its filter."""

    def __init__(self, faults: TransferFaults) -> None:
        self._lock = threading.Lock()
        self._corrupt = faults.corrupt_pushes
        self._stall = faults.stall_pushes
        self._stall_s = faults.stall_s
        self.injected = 0

    def next_filter(self) -> MessageFilter | None:
        """The filter for the next push, or None when no fault is left."""
        with self._lock:
            if self._corrupt > 0:
                self._corrupt -= 1
                self.injected += 1
                return _on_first_chunk(_flip_last_byte)
            if self._stall > 0:
                self._stall -= 1
                self.injected += 1
                stall_s = self._stall_s
                return _on_first_chunk(lambda msg: _sleep_then(msg, stall_s))
        return None


def _flip_last_byte(msg: bytes) -> bytes:
    broken = bytearray(msg)
    broken[-1] ^= 0xFF
    return bytes(broken)


def _sleep_then(msg: bytes, stall_s: float) -> bytes:
    time.sleep(stall_s)
    return msg


def _on_first_chunk(fault: Callable[[bytes], bytes]) -> MessageFilter:
    """Apply ``fault`` to the second message (the first chunk) only."""
    count = 0

    def apply(msg: bytes) -> bytes:
        nonlocal count
        count += 1
        return fault(msg) if count == 2 else msg

    return apply
