"""Which failures a request is retried after, and the backoff between tries."""

from __future__ import annotations

import grpc
import pytest
import ray.exceptions

from kv_transfer import TransferError
from router.failover import NoWorkerAvailable, RetryPolicy, WorkerLost, is_retryable

pytestmark = pytest.mark.unit


def test_backoff_doubles_up_to_the_cap():
    policy = RetryPolicy(max_attempts=6, backoff_s=0.1, max_backoff_s=0.5)
    assert [policy.delay(i) for i in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def _task_error(cause: Exception) -> Exception:
    return ray.exceptions.RayTaskError("prefill", "traceback", cause).as_instanceof_cause()


@pytest.mark.parametrize(
    "exc",
    [
        WorkerLost("decode-1", "stream broke"),
        NoWorkerAvailable("all restarting"),
        TransferError(grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
        TransferError(grpc.StatusCode.DEADLINE_EXCEEDED, "stalled"),
        ray.exceptions.ActorDiedError(),
        _task_error(TransferError(grpc.StatusCode.DATA_LOSS, "checksum mismatch")),
        _task_error(LookupError("no KV blocks arrived for request 'x'")),
        _task_error(ConnectionError("router has no open output stream here")),
    ],
)
def test_worker_and_transfer_failures_are_retried(exc):
    assert is_retryable(exc)


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad"),
        _task_error(ValueError("prompt is empty")),
        RuntimeError("a bug"),
    ],
)
def test_invalid_requests_and_bugs_are_not_retried(exc):
    assert not is_retryable(exc)


def test_transfer_error_survives_pickling():
    # Ray pickles an actor call's exception to the caller (the router).
    import pickle

    err = pickle.loads(pickle.dumps(TransferError(grpc.StatusCode.DATA_LOSS, "bad chunk")))
    assert (err.code, err.message) == (grpc.StatusCode.DATA_LOSS, "bad chunk")
    assert is_retryable(_task_error(err))
