"""Failover: which failures a request survives, and how long it waits
between tries.

A request is tried again, on other workers where there are any, when a
worker died (a Ray actor error, or its output stream broke), a KV transfer
failed (deadline, bad checksum, peer gone) or no worker was available. Each
try has its own worker-side request id, and the failed one is aborted on the
workers it used, so no try can leave blocks behind. A decode failover
resumes: the next try prefills the prompt plus the tokens already streamed
and goes on from there (see ``RayBackend.generate``).

What a resumed stream guarantees:

- no token lost or repeated: the client has exactly the tokens the router
  streamed, and the next try starts after the last of them;
- max_tokens, min_tokens, stop strings, stop token ids and the penalties
  count the streamed tokens as outputs, and the detokenizer replays them,
  so text deltas continue where they stopped;
- greedy requests give the same output as an undisturbed run;
- seeded sampled requests too: the draw for output token i depends only on
  (seed, i) (``engine.sampling.token_seed``);
- unseeded sampled requests continue with a fresh draw from the same
  distribution, conditioned on what was streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray.exceptions

from kv_transfer import TransferError
from kv_transfer.interface import PushNoRoom
from protocol.outputs import RequestFailed


class WorkerLost(Exception):
    """A worker a try depended on died, or dropped the request."""

    def __init__(self, worker: str, why: str) -> None:
        super().__init__(f"worker {worker} lost: {why}")
        self.worker = worker


class RequestFault(Exception):
    """A worker failed the request for a fault tied to it (non-finite
    logits, an error in its own step): finish_reason "error" on its stream,
    or a prefill call that raised ``RequestFailed``. Tried again elsewhere,
    but a request that meets ``MAX_REQUEST_FAULTS`` of them fails (INTERNAL):
    it is not tried on every worker."""

    def __init__(self, worker: str, message: str) -> None:
        super().__init__(f"worker {worker} failed the request: {message}")
        self.worker = worker
        self.message = message


MAX_REQUEST_FAULTS = 2


def request_fault(worker: str, exc: BaseException) -> RequestFault | None:
    """The RequestFault a worker call's exception stands for, if any (Ray
    raises a RequestFailed of the worker as a RayTaskError with that cause).
    Its message is the cause's own: the RayTaskError is a RequestFailed too,
    but its text is the worker's traceback, pid and address, which are not
    the client's to read."""
    cause = getattr(exc, "cause", None)
    for e in (cause, exc):
        if isinstance(e, RequestFailed):
            return RequestFault(worker, str(e))
    return None


def is_no_room(exc: BaseException) -> bool:
    """A push that found no KV room on its decode worker within its wait
    (kv_transfer/service.py): the pool was full, not a failed try (Ray raises
    the worker's PushNoRoom as a RayTaskError with that cause)."""
    return any(isinstance(e, PushNoRoom) for e in (exc, getattr(exc, "cause", None)))


class NoWorkerAvailable(LookupError):
    """Every worker of a pool is down (being restarted) right now."""


# Wait before a request's first retry (it doubles with each further one) and
# the longest wait between two tries: long enough for Ray to report a dead
# actor, short against any request's deadline.
RETRY_BACKOFF_S = 0.1
RETRY_BACKOFF_MAX_S = 2.0


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4
    backoff_s: float = RETRY_BACKOFF_S
    max_backoff_s: float = RETRY_BACKOFF_MAX_S

    def delay(self, failures: int) -> float:
        """Wait after the ``failures``-th failed try (1, 2, ...)."""
        return min(self.backoff_s * 2 ** (failures - 1), self.max_backoff_s)


def is_retryable(exc: BaseException) -> bool:
    """True for failures another try may not meet: lost workers, failed
    transfers, requests a worker no longer knows. A request the engine
    refused as invalid (ValueError) fails at once."""
    if isinstance(
        exc,
        (WorkerLost, RequestFault, NoWorkerAvailable, TransferError, ray.exceptions.RayActorError),
    ):
        return True
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        return not isinstance(cause, (ValueError, TypeError, AssertionError))
    return isinstance(exc, (ConnectionError, LookupError, TimeoutError))


@dataclass
class FailoverStats:
    """Counters the backend keeps (Admin status, tests, the chaos report)."""

    retries: int = 0  # tries after a failed one
    resumed: int = 0  # tries that continued a stream with tokens already sent
    failed: int = 0  # requests that ran out of tries
    faulted: int = 0  # requests failed (INTERNAL) after MAX_REQUEST_FAULTS faults tied to them
    no_room: int = 0  # tries whose push found no KV room in its wait: queued again, not failed
    workers_lost: int = 0  # workers taken out of routing after a failure
    workers_recovered: int = 0  # taken back after their health check passed
