"""Faults for the chaos tests (tests/integration/test_chaos.py) and the
request-fault tests: prefill workers whose next pushes fail in a chosen way,
and engines whose logits turn NaN for chosen requests.

A deployment started with ``actor_classes={"prefill": FaultyPrefillActor}``
(benchkit/deployment.py, which sets router/pool_manager.py's
``WorkerPool.actor_cls``) runs this actor instead of PrefillActor; nothing in
the product knows of it. ``set_faults`` arms the worker's next pushes: each
takes at most one fault, and a push with a fault goes through a GrpcKVClient
of its own with a message filter (kv_transfer/grpc_client.py), the others
through the worker's shared client, as in production.

A filter sees every outgoing push message (the header first, then each chunk,
or each data-channel frame with its payload, then the commit). ``corrupt``
flips the last byte of the first chunk, so the receiver's checksum check
fails (DATA_LOSS); ``stall`` holds the first chunk back for ``stall_s``, so
the push's deadline passes before it is sent; ``kill`` ends the worker's
process at the first chunk, after the decode worker reserved the blocks.

``inject_nan`` makes an engine's hidden states (so its logits, on every
sampling path) NaN for the requests a predicate picks; the Faulty*Actor
classes install it for prompts that start with ``NAN_PROMPT`` (a public
request cannot produce NaN logits once validated: docs/failures.md).

The Ray workers import this module by name, so the repository root must be
on their ``sys.path``: Ray puts the driver's working directory there, and the
tests run from the repository root (pytest's rootdir).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decode_pool.actor import DecodeActor
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from kv_transfer import GrpcKVClient, PushResult
from kv_transfer.feed import KVFeed
from kv_transfer.grpc_client import MessageFilter
from kv_transfer.interface import PushHeader
from prefill_pool.actor import PrefillActor
from prefill_pool.worker import PrefillWorker

NAN_PROMPT = [13, 37, 13, 37]
"""A prompt that starts with these token ids gets NaN logits on a worker of
a Faulty*Actor class."""
NAN_LATE_PROMPT = [13, 37, 13, 38]
"""Likewise, once the request has two output tokens (its decode fails, after
two tokens were streamed)."""


def inject_nan(engine: LLMEngine, poisoned: Callable[[Sequence], bool]) -> None:
    """From now on, the rows ``engine`` samples for sequences ``poisoned``
    picks have a NaN hidden state, as a broken KV block or kernel would give."""
    sample = engine._sample

    def poisoned_sample(seqs: list[Sequence], hidden: torch.Tensor):
        rows = [i for i, seq in enumerate(seqs) if poisoned(seq)]
        if rows:
            hidden = hidden.clone()
            hidden[rows] = float("nan")
        return sample(seqs, hidden)

    engine._sample = poisoned_sample  # type: ignore[method-assign]


def starts_with_nan_prompt(seq: Sequence) -> bool:
    """``NAN_PROMPT`` at once, ``NAN_LATE_PROMPT`` from its third token on."""
    head = seq.prompt_token_ids[: len(NAN_PROMPT)]
    return head == NAN_PROMPT or (head == NAN_LATE_PROMPT and len(seq.output_token_ids) >= 2)


@dataclass(frozen=True)
class TransferFaults:
    """Faults for a worker's next pushes (each push takes at most one)."""

    corrupt_pushes: int = 0
    """The next this many pushes have a byte of their first chunk flipped."""
    stall_pushes: int = 0
    """Then the next this many pushes stall before their first chunk."""
    stall_s: float = 0.0
    """How long a stalled push waits (longer than the transfer deadline)."""
    kill_pushes: int = 0
    """Then the next this many pushes kill their worker's process (SIGKILL) at
    their first chunk: a sender dead half-way through a push."""


class FaultPlan:
    """What is left of a ``TransferFaults``; hands each push its filter."""

    def __init__(self, faults: TransferFaults) -> None:
        self._lock = threading.Lock()
        self._corrupt = faults.corrupt_pushes
        self._stall = faults.stall_pushes
        self._stall_s = faults.stall_s
        self._kill = faults.kill_pushes
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
            if self._kill > 0:
                self._kill -= 1
                self.injected += 1
                return _on_first_chunk(_die)
        return None


def _flip_last_byte(msg: bytes) -> bytes:
    broken = bytearray(msg)
    broken[-1] ^= 0xFF
    return bytes(broken)


def _sleep_then(msg: bytes, stall_s: float) -> bytes:
    time.sleep(stall_s)
    return msg


def _die(msg: bytes) -> bytes:
    os.kill(os.getpid(), signal.SIGKILL)
    return msg


def _on_first_chunk(fault: Callable[[bytes], bytes]) -> MessageFilter:
    """Apply ``fault`` to the second message (the first chunk) only."""
    count = 0

    def apply(msg: bytes) -> bytes:
        nonlocal count
        count += 1
        return fault(msg) if count == 2 else msg

    return apply


class FaultyPrefillWorker(PrefillWorker):
    """A PrefillWorker whose pushes take the faults of its plan."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults = FaultPlan(TransferFaults())
        inject_nan(self.engine, starts_with_nan_prompt)

    async def _push(self, address: str, header: PushHeader, feed: KVFeed) -> PushResult:
        fault = self.faults.next_filter()
        if fault is None:
            return await super()._push(address, header, feed)
        client = GrpcKVClient(self.transfer_config, message_filter=fault)
        try:
            return await client.stream(address, header, feed)
        finally:
            await client.close()


class FaultyPrefillActor(PrefillActor):
    """PrefillActor plus the chaos tests' calls."""

    worker: FaultyPrefillWorker

    @staticmethod
    def make_worker(name, config, transfer, index, host) -> FaultyPrefillWorker:
        return FaultyPrefillWorker(name, config, transfer, index, host)

    async def set_faults(self, faults: TransferFaults) -> None:
        """Make the next pushes fail (replaces what is left of earlier faults)."""
        self.worker.faults = FaultPlan(faults)

    async def faults_injected(self) -> int:
        """Faults injected since the actor process started."""
        return self.worker.faults.injected


class FaultyDecodeActor(DecodeActor):
    """DecodeActor (decode or colocated) whose engine gives NaN logits to
    prompts that start with ``NAN_PROMPT``."""

    @staticmethod
    def make_worker(name, config, transfer, index, host):
        worker = DecodeActor.make_worker(name, config, transfer, index, host)
        inject_nan(worker.engine, starts_with_nan_prompt)
        return worker
