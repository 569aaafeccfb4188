"""A request's deltas queued behind the one being handled go to the client as
one chunk: tokens, text and logprobs in order, the last delta's end state."""

from __future__ import annotations

import pytest

from protos.tandem.v1 import generate_pb2, worker_pb2
from router.worker_streams import LOST, DeltaQueue, merge_queued

pytestmark = pytest.mark.unit


def _delta(tokens: list[int], text: str, **end) -> worker_pb2.RequestDelta:
    return worker_pb2.RequestDelta(
        request_id="r",
        token_ids=tokens,
        text=text,
        logprobs=[generate_pb2.TokenLogprob(token_id=t, logprob=-t / 10) for t in tokens],
        **end,
    )


def _queue(*items) -> DeltaQueue:
    queue = DeltaQueue()
    for item in items:
        if item is LOST:
            queue.put_lost()
        else:
            queue.put(item)
    return queue


def test_queued_deltas_fold_into_one_up_to_the_finished_one():
    queue = _queue(
        _delta([2], "b"),
        _delta([3, 4], "cd", finished=True, finish_reason="length", num_output_tokens=4),
        _delta([9], "late"),  # after the end: not folded in
    )
    merged = merge_queued(_delta([1], "a", num_output_tokens=1), queue)
    assert list(merged.token_ids) == [1, 2, 3, 4]
    assert merged.text == "abcd"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.finished and merged.finish_reason == "length"
    assert merged.num_output_tokens == 4 and merged.request_id == "r"
    assert list(queue.get_nowait().token_ids) == [9] and queue.empty()


def test_nothing_queued_leaves_the_delta_as_it_is():
    delta = _delta([5], "x", num_output_tokens=3)
    assert merge_queued(delta, _queue()) == _delta([5], "x", num_output_tokens=3)


def test_a_finished_delta_takes_nothing_more():
    queue = _queue(_delta([7], "y"))
    merged = merge_queued(_delta([6], "x", finished=True, finish_reason="stop"), queue)
    assert list(merged.token_ids) == [6] and queue.next_is_delta()


def test_lost_stays_queued_after_the_tokens_before_it():
    queue = _queue(_delta([2], "b"), LOST)
    merged = merge_queued(_delta([1], "a"), queue)
    assert list(merged.token_ids) == [1, 2] and merged.text == "ab"
    assert queue.get_nowait() is LOST and queue.empty()


@pytest.mark.parametrize("reason", ["error", "abort"])
def test_a_failing_end_stays_queued_behind_the_tokens_before_it(reason):
    """The router raises on a failed end; folded in, it would take the tokens
    the worker streamed before the fault with it."""
    failed = _delta([], "", finished=True, finish_reason=reason, error="boom")
    queue = _queue(_delta([2], "b"), failed)
    merged = merge_queued(_delta([1], "a"), queue)
    assert list(merged.token_ids) == [1, 2] and not merged.finished
    assert queue.next_fails() and queue.get_nowait() == failed and queue.empty()
