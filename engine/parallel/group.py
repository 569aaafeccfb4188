"""The ranks of one tensor-parallel engine and what they say to each other.

Rank 0 runs the engine (scheduler, block pool, sampler); ranks 1..N-1 run
their share of the model only (engine/parallel/rank.py). Three process
groups connect them, built from one rendezvous:

- ``steps`` (gloo): rank 0 broadcasts each pass's inputs as one message
  (engine/parallel/messages.py), and the ranks run it; only the engine
  thread uses it.
- ``model``: the all-reduce after o and down, the LM head's gather. The
  steps group itself on CPU; NCCL on CUDA.
- ``kv`` (gloo): KV blocks gathered to rank 0 and scattered from it, for a
  transfer (engine/parallel/kv.py), from the transfer's threads while the
  engine thread runs steps.

The rendezvous is a FileStore in a directory only this user can read, so no
port is opened for it; gloo's connections bind the loopback address (and
NCCL's, ``NCCL_LOOPBACK``), so the ranks of a group share one machine.
gloo authenticates nobody, so once built, each group's ranks prove to each
other that they hold the engine's secret (engine/parallel/auth.py) before
anything else crosses it; what they read is decoded as data, never code
(messages.py). The traffic itself is not encrypted.

A rank that dies closes its connections; the others' next collective
raises at once. An idle rank waits for the next message without a
timeout; rank 0 waits at most ``KV_TIMEOUT`` for the others in a KV read
or write, so that a rank that hangs fails the transfer (and breaks the
group, as a dead rank does) instead of holding its blocks forever.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from engine.parallel import auth, messages

CONNECT_TIMEOUT = datetime.timedelta(seconds=300)  # to build a group once every rank is up
IDLE_TIMEOUT = datetime.timedelta(days=3650)  # a rank waits for the next step forever
# Rank 0's bound on one KV read or write (a gather or scatter of one chunk's
# heads, over loopback): past it the rank it waits on is taken for hung.
KV_TIMEOUT = datetime.timedelta(seconds=60)
LOOPBACK = "127.0.0.1"
# Set in every rank's process before its NCCL group is built: NCCL's bootstrap
# and socket connections bind the loopback interface, not the node's network.
NCCL_LOOPBACK = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_SOCKET_FAMILY": "AF_INET"}


class GroupBroken(RuntimeError):
    """A collective failed (a rank died, or the ranks fell out of step):
    the engine cannot run another pass."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one engine meet."""

    directory: str  # 0700, rank 0's; the store file and nothing else
    world_size: int
    backend: Literal["gloo", "nccl"]

    @classmethod
    def new(cls, world_size: int, backend: Literal["gloo", "nccl"]) -> Rendezvous:
        return cls(tempfile.mkdtemp(prefix="tandem-tp-"), world_size, backend)

    @property
    def store_path(self) -> str:
        return os.path.join(self.directory, "store")

    def store(self) -> dist.FileStore:
        store = dist.FileStore(self.store_path, self.world_size)
        store.set_timeout(CONNECT_TIMEOUT)
        return store

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class RankGroup:
    """This rank's end of the three groups (building it blocks until every
    rank builds its own)."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        rank: int,
        store: dist.Store,
        device: torch.device,
        secret: bytes,
    ) -> None:
        """``device``: this rank's (NCCL binds each rank's communicator to it).
        ``secret``: the engine's (auth.py); raises auth.PeerRefused when a rank
        does not prove it, before anything else crosses the groups."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.rank, self.size = rank, rendezvous.world_size
        self.steps = _gloo(dist.PrefixStore("steps", store), rank, self.size)
        self.kv = _gloo(dist.PrefixStore("kv", store), rank, self.size)
        auth.pairwise(self.steps, "steps", rank, self.size, secret)
        auth.pairwise(self.kv, "kv", rank, self.size, secret)
        self.model = self.steps
        if rendezvous.backend == "nccl":
            os.environ.update(NCCL_LOOPBACK)
            self.model = _nccl(dist.PrefixStore("model", store), rank, self.size)
            auth.gathered(self.model, "model", rank, self.size, secret, device)
        self.broken: str | None = None
        self.barrier(self.steps)  # every rank is done with the store: rank 0 may remove it
        self.steps.set_timeout(IDLE_TIMEOUT)
        self.kv.set_timeout(KV_TIMEOUT if rank == 0 else IDLE_TIMEOUT)

    # ---- messages from rank 0 ----------------------------------------------

    def broadcast(self, pg: Any, message: object = None) -> Any:
        """Rank 0: send ``message`` (engine/parallel/messages.py) to every rank;
        the others: the message rank 0 sent."""
        with self._failing():
            if self.rank == 0:
                payload = torch.frombuffer(bytearray(messages.encode(message)), dtype=torch.uint8)
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                pg.broadcast([size]).wait()
                pg.broadcast([payload]).wait()
                return message
            size = torch.zeros(1, dtype=torch.int64)
            pg.broadcast([size]).wait()
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            pg.broadcast([payload]).wait()
            return messages.decode(payload.numpy().tobytes())

    # ---- collectives ---------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (the model group); returns it."""
        with self._failing():
            self.model.allreduce([t]).wait()
        return t

    def gather(self, pg: Any, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape and dtype) at rank 0, in rank order; None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t = t.contiguous()
        out = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        with self._failing():
            pg.gather(out, [t], opts).wait()
        return out[0] if self.rank == 0 else None

    def scatter(self, pg: Any, parts: list[torch.Tensor] | None, out: torch.Tensor) -> None:
        """Rank 0's ``parts[r]`` into rank r's ``out``."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        inputs = [[p.contiguous() for p in parts]] if self.rank == 0 and parts else []
        with self._failing():
            pg.scatter([out], inputs, opts).wait()

    def barrier(self, pg: Any) -> None:
        """Every rank reached this point (an all-reduce of one value)."""
        with self._failing():
            pg.allreduce([torch.zeros(1)]).wait()

    # ---- failure ---------------------------------------------------------------

    def _check(self) -> None:
        if self.broken is not None:
            raise GroupBroken(f"tensor-parallel group is broken: {self.broken}")

    def _failing(self) -> _Failing:
        return _Failing(self)

    def fail(self, why: str) -> None:
        """Mark the group unusable (a pass or a collective failed half-way)."""
        if self.broken is None:
            self.broken = why


class _Failing:
    """Turns a collective's error into GroupBroken, and marks the group."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def __enter__(self) -> None:
        self.group._check()

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, GroupBroken):
            return False
        if isinstance(exc, RuntimeError):  # gloo's and NCCL's errors
            self.group.fail(str(exc).splitlines()[0][:300])
            raise GroupBroken(f"tensor-parallel collective failed: {self.group.broken}") from exc
        return False


def wait_ready(store: dist.Store, world_size: int, lost: Any, timeout_s: float) -> None:
    """Rank 0: wait until ranks 1..N-1 have loaded their share (each sets
    ``ready/<rank>``). Raises RuntimeError with a rank's error (``error/<rank>``),
    or ``lost()``'s account of a rank gone without one, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, world_size))
    while pending:
        for rank in sorted(pending):
            if store.check([f"error/{rank}"]):
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {_text(store, rank)}")
            if store.check([f"ready/{rank}"]):
                pending.discard(rank)
        gone = lost()
        if pending and gone:
            raise RuntimeError(f"tensor-parallel rank gone before it was ready: {gone}")
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel ranks {sorted(pending)} not ready in {timeout_s} s"
            )
        if pending:
            time.sleep(0.05)


def rank_error(store: dist.Store, world_size: int) -> str | None:
    """The first error a rank 1..N-1 left in the store, if any."""
    for rank in range(1, world_size):
        if store.check([f"error/{rank}"]):
            return f"tensor-parallel rank {rank} failed: {_text(store, rank)}"
    return None


def _text(store: dist.Store, rank: int) -> str:
    return store.get(f"error/{rank}").decode(errors="replace")


def _gloo(store: dist.Store, rank: int, size: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    opts._timeout = CONNECT_TIMEOUT  # until the group is proven (RankGroup sets its own)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int) -> Any:  # pragma: no cover - needs GPUs
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = IDLE_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, size, opts)
