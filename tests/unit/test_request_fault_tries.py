"""The router's tries of a request that a worker failed for a fault tied to
it (finish_reason "error" on the decode stream, or a prefill call raising
RequestFailed): tried again on another worker, failed with INTERNAL once it
failed so on two; a worker whose steps keep failing leaves routing. A lost
worker is still retried as before. Fake actors and streams, as in
tests/unit/test_request_tries.py."""

from __future__ import annotations

import grpc
import pytest

from engine import EngineConfig, LLMEngine
from protocol.outputs import RequestFailed
from protocol.workers import UNHEALTHY_FAILED_STEPS, WorkerHealth
from protos.tandem.v1 import worker_pb2
from router.failover import WorkerLost, request_fault
from router.messages import RequestError
from router.pool_manager import WorkerHandle
from tests.pool_checks import leftover_holders
from tests.unit.test_request_tries import (
    PARAMS,
    PROMPT,
    Setup,
    Try,
    _Method,
    assert_clean,
    collect,
    make_backend,
    rid_of,
    run,
    settle,
)
from worker.output_wire import to_delta

pytestmark = pytest.mark.unit

NAN = "the model produced non-finite logits (NaN or inf) for this request"


class Health:
    """The fake workers' health answers: which are failing, who was asked."""

    def __init__(self, setup: Setup) -> None:
        self.failing: set[str] = set()
        self.asked: list[str] = []
        for w in setup.prefill + setup.decode:
            w.actor.health = _Method(lambda w=w: self._answer(w))

    async def _answer(self, w: WorkerHandle) -> WorkerHealth:
        self.asked.append(w.name)
        failed = UNHEALTHY_FAILED_STEPS if w.name in self.failing else 0
        return WorkerHealth(w.name, w.info.incarnation, True, 10, 10, 0, failed)


def _fail(t: Try, error: str = NAN) -> None:
    """The decode worker's engine failed the request alone."""
    t.queue.put(
        worker_pb2.RequestDelta(
            request_id=rid_of(t),
            finished=True,
            finish_reason="error",
            error=error,
            num_output_tokens=len(t.request.output_token_ids) + t.sent,
        )
    )


async def _stream_then_fail(t: Try):
    t.push(11)
    t.push(12)
    _fail(t)
    return t.result()


async def _resume(t: Try):
    t.push(13)
    t.push(14, finished=True, reason="length")
    return t.result()


async def _refused(setup) -> RequestError:
    """The RequestError the client gets, once the router has settled."""
    with pytest.raises(RequestError) as err:
        await collect(setup)
    await settle(setup)
    return err.value


def test_a_request_failed_on_one_worker_resumes_on_another():
    setup = make_backend([_stream_then_fail, _resume])
    health = Health(setup)
    tokens, result = run(collect(setup))
    first, second = setup.cluster.tries
    assert tokens in ([11, 12, 13, 14], [13, 14])  # the first try's tokens may be merged away
    if tokens == [11, 12, 13, 14]:
        assert second.request.output_token_ids == [11, 12]
    assert result.finish_reason == "length"
    assert second.decode_worker != first.decode_worker
    assert health.asked == [first.decode_worker]  # and it answered healthy: it stays
    assert {w.name for w in setup.backend.decode.workers} == {"d0", "d1"}
    assert setup.cluster.aborts == [(first.decode_worker, rid_of(first))]
    assert setup.backend.failover.faulted == 0
    assert_clean(setup)


def test_a_request_failed_on_two_workers_fails_with_internal():
    async def fail_at_once(t: Try):
        _fail(t)
        return t.result()

    setup = make_backend([fail_at_once, fail_at_once])
    Health(setup)

    err = run(_refused(setup))
    first, second = setup.cluster.tries
    assert err.code == grpc.StatusCode.INTERNAL
    assert "failed in 2 tries" in str(err) and NAN in str(err)
    assert {first.decode_worker, second.decode_worker} == {"d0", "d1"}
    assert sorted(setup.cluster.aborts) == sorted(
        [(first.decode_worker, rid_of(first)), (second.decode_worker, rid_of(second))]
    )
    assert setup.backend.failover.faulted == 1
    assert_clean(setup)


def test_a_prefill_call_that_failed_the_request_counts_as_a_fault():
    """The prefill worker's engine failed it (RequestFailed, as Ray raises
    it); then a decode worker failed it too: two faults, INTERNAL."""

    async def prefill_fails(t: Try):
        raise RequestFailed(NAN)

    async def decode_fails(t: Try):
        _fail(t, "its step failed: RuntimeError: bad block")
        return t.result()

    setup = make_backend([prefill_fails, decode_fails])
    health = Health(setup)

    err = run(_refused(setup))
    first, second = setup.cluster.tries
    assert err.code == grpc.StatusCode.INTERNAL
    assert "bad block" in str(err)
    assert health.asked == [first.prefill_worker, second.decode_worker]
    assert second.prefill_worker != first.prefill_worker
    assert_clean(setup)


def test_a_fault_raised_through_ray_carries_the_workers_message_alone():
    """As Ray raises a worker's RequestFailed: a RayTaskError that is also a
    RequestFailed, whose text is the remote traceback. The client gets the
    worker's message, not the traceback, pid or address."""
    from ray.exceptions import RayTaskError

    remote = 'Traceback (most recent call last):\n  File "/srv/prefill_pool/worker.py", line 9'
    exc = RayTaskError("prefill", remote, RequestFailed(NAN), pid=4242, ip="10.0.0.7")
    fault = request_fault("prefill-0", exc.as_instanceof_cause())
    assert fault is not None
    assert fault.message == NAN
    assert str(fault) == f"worker prefill-0 failed the request: {NAN}"


def test_lost_workers_are_still_retried_past_two():
    async def lost(t: Try):
        raise WorkerLost(t.prefill_worker or "?", "actor died")

    async def serve(t: Try):
        t.push(21, finished=True, reason="stop")
        return t.result()

    setup = make_backend([lost, lost, serve])
    Health(setup)
    tokens, result = run(collect(setup))
    assert tokens == [21] and result.finish_reason == "stop"
    assert len(setup.cluster.tries) == 3
    assert setup.backend.failover.retries == 2
    assert_clean(setup)


async def _stream_then_drop(t: Try):
    """The decode worker's engine aborted the request (no step of it could
    run, even alone): the worker's fault, not the request's."""
    t.push(11)
    t.push(12, finished=True, reason="abort")
    return t.result()


@pytest.mark.parametrize("ending", [_stream_then_fail, _stream_then_drop], ids=["error", "abort"])
def test_a_worker_whose_steps_keep_failing_leaves_routing_until_it_passes(ending):
    setup = make_backend([ending, _resume])
    health = Health(setup)
    recovery = setup.backend.recovery
    recovery.poll_s = 0.01
    health.failing = {"d0", "d1"}

    async def main():
        tokens, _ = await collect(setup)
        first = setup.cluster.tries[0]
        out = [w.name for w in setup.backend.decode.workers]
        assert recovery.is_down(setup.worker(first.decode_worker))
        health.failing.clear()  # its steps pass again: the recovery watcher takes it back
        await recovery.wait_all(timeout_s=10)
        back = [w.name for w in setup.backend.decode.workers]
        await settle(setup)
        return tokens, first, out, back

    tokens, first, out, back = run(main())
    assert tokens[-2:] == [13, 14]  # served by the other decode worker
    assert first.decode_worker not in out
    assert sorted(back) == ["d0", "d1"]
    assert setup.backend.failover.workers_lost == 1
    assert setup.backend.failover.workers_recovered == 1
    assert_clean(setup)


def test_requests_no_step_could_run_even_alone_are_retried_past_two_and_succeed(llama_dir):
    """A decode engine whose every pass raises (a lost device) aborts the
    request with its batch neighbour: a lost worker to the router, which
    tries it again, past two tries, and charges no fault to it; the next
    worker serves it with the tokens of an undisturbed run. The engine's
    pool is as it started."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    start = engine.block_pool.num_free
    forward = engine._forward

    def device_lost(batch):
        raise RuntimeError("device lost")

    def decode(t: Try, *neighbours: str) -> None:
        """The decode worker: the try's request (and others in its batch) to
        the end, its outputs on the try's stream as the worker sends them."""
        rid = rid_of(t)
        req = t.request
        engine.add_request(rid, req.prompt_token_ids, req.params, False, req.output_token_ids)
        for i, other in enumerate(neighbours):
            engine.add_request(other, PROMPT[i:], PARAMS)
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    t.queue.put(to_delta(out))

    async def on_a_lost_device(t: Try):
        engine._forward = device_lost
        decode(t, f"{rid_of(t)}/neighbour")
        return t.result()

    async def on_a_good_one(t: Try):
        engine._forward = forward
        decode(t)
        return t.result()

    reference, reason = [], None
    engine.add_request("reference", PROMPT, PARAMS)
    while engine.has_unfinished():
        for out in engine.step():
            reference += out.new_token_ids
            reason = out.finish_reason or reason

    setup = make_backend([on_a_lost_device] * 3 + [on_a_good_one])
    health = Health(setup)
    tokens, result = run(collect(setup))
    tries = setup.cluster.tries
    assert tokens == reference and result.finish_reason == reason
    assert len(tries) == 4
    assert setup.backend.failover.retries == 3 and setup.backend.failover.faulted == 0
    assert health.asked == [t.decode_worker for t in tries[:3]]  # answered healthy: stays
    assert tries[1].decode_worker != tries[0].decode_worker
    assert sorted(setup.cluster.aborts) == sorted((t.decode_worker, rid_of(t)) for t in tries[:3])
    assert engine.request_ids() == []
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == start
    assert_clean(setup)
