"""Faults tied to one request stay with it: a NaN row, a pass that raises
because of one sequence, an error in one sequence's bookkeeping. The
request fails alone (finish_reason "error" with a message), its blocks are
freed, and the rest of the batch gets exactly the tokens of a run without
it. Every test ends with the pool as it started."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.config import SpeculativeConfig
from engine.sampling import (
    NONFINITE_LOGITS,
    NOTHING_TO_SAMPLE,
    Sampler,
    SampleRequest,
    make_generator,
)
from protocol.sampling import SamplingParams
from protocol.workers import FAILING_WINDOW_S, UNHEALTHY_FAILED_STEPS
from tests.faults import NAN_PROMPT, inject_nan, starts_with_nan_prompt
from tests.pool_checks import leftover_holders
from worker.base import EngineWorker

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
PENALIZED = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(llama_dir, cpu_kernels: str = "auto") -> LLMEngine:
    """cpu_kernels "auto": the fused CPU path (and its greedy screen) where the
    kernels build, "off": the PyTorch path."""
    return LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, cpu_kernels=cpu_kernels))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Every request's tokens and its last output, stepping until all are done."""
    start = engine.block_pool.num_free
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    last = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    assert all(out.finished for out in last.values())
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == start
    return {"tokens": tokens, "last": last}


def _requests(params: SamplingParams) -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        "a": (_prompt(9, 1), params),
        "b": (_prompt(40, 2), SEEDED),
        "c": (_prompt(21, 3), params),
    }


@pytest.mark.parametrize("kernels", ["auto", "off"])
@pytest.mark.parametrize(
    "params",
    [GREEDY, GREEDY_LOGPROBS, SEEDED, PENALIZED],
    ids=["greedy", "logprobs", "seeded", "penalized"],
)
def test_a_nan_row_fails_its_request_and_the_batch_keeps_its_tokens(llama_dir, params, kernels):
    reference = _run(_engine(llama_dir, kernels), _requests(params))["tokens"]

    engine = _engine(llama_dir, kernels)
    inject_nan(engine, starts_with_nan_prompt)
    requests = _requests(params)
    requests["nan"] = (NAN_PROMPT + _prompt(30, 4), params)
    got = _run(engine, requests)
    failed = got["last"]["nan"]
    assert (failed.finish_reason, failed.error) == ("error", NONFINITE_LOGITS)
    assert got["tokens"]["nan"] == []
    assert {rid: got["tokens"][rid] for rid in reference} == reference
    assert engine.failed_steps == 0  # a fault of one request is not the worker's


def test_a_request_that_turns_nan_mid_decode_fails_after_its_streamed_tokens(llama_dir):
    engine = _engine(llama_dir)
    inject_nan(engine, lambda seq: seq.request_id == "late" and len(seq.output_token_ids) >= 3)
    got = _run(engine, {"late": (_prompt(20, 5), GREEDY), "ok": (_prompt(20, 6), GREEDY)})
    assert len(got["tokens"]["late"]) == 3
    assert got["last"]["late"].finish_reason == "error"
    assert got["last"]["late"].num_output_tokens == 3
    assert len(got["tokens"]["ok"]) == GREEDY.max_tokens


def test_the_blocks_of_a_nan_request_leave_the_prefix_cache(llama_dir):
    """Its KV may be what broke it: a later request with the same prompt
    computes the prefix again instead of reading those blocks."""
    engine = _engine(llama_dir)
    prompt = _prompt(48, 7)  # three full blocks
    inject_nan(engine, lambda seq: seq.request_id == "first" and len(seq.output_token_ids) >= 2)
    _run(engine, {"first": (prompt, GREEDY)})
    got = _run(engine, {"second": (prompt, GREEDY)})
    assert got["last"]["second"].num_cached_tokens == 0


def test_a_pass_that_raises_for_one_sequence_fails_only_that_one(llama_dir):
    reference = _run(_engine(llama_dir), _requests(GREEDY))["tokens"]
    engine = _engine(llama_dir)
    forward = engine._forward

    def broken_forward(batch):
        if any(item.seq.request_id == "culprit" for item in batch):
            raise RuntimeError("kernel fault\nwith a second line")
        return forward(batch)

    engine._forward = broken_forward
    requests = _requests(GREEDY)
    requests["culprit"] = (_prompt(12, 8), GREEDY)
    got = _run(engine, requests)
    assert got["last"]["culprit"].finish_reason == "error"
    assert got["last"]["culprit"].error == "its step failed: RuntimeError: kernel fault"
    assert {rid: got["tokens"][rid] for rid in reference} == reference
    # One step raised; the steps after it ran whole again.
    assert engine.failed_steps == 0


class Clock:
    """A clock the test moves (the engine's ``clock``): no waiting on time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _device_lost(batch):
    raise RuntimeError("device lost")


def test_a_step_of_one_sequence_that_raises_is_that_requests_fault(llama_dir):
    engine = _engine(llama_dir)
    start = engine.block_pool.num_free
    engine._forward = _device_lost
    for i in range(UNHEALTHY_FAILED_STEPS + 2):
        engine.add_request(f"r{i}", _prompt(10, i), GREEDY)
        outs = engine.step()
        assert [(o.request_id, o.finish_reason, o.error) for o in outs] == [
            (f"r{i}", "error", "its step failed: RuntimeError: device lost")
        ]
        assert engine.recent_failed_steps() == 0  # not the worker's
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == start


def test_steps_whose_sequences_raise_even_alone_abort_them_and_count(llama_dir):
    """No sequence runs alone either: nothing tells whose fault it is. They are
    aborted (the router tries them again elsewhere, as after a lost worker),
    not failed, and the steps count against the worker while they are recent."""
    engine = _engine(llama_dir)
    engine.clock = clock = Clock()
    start = engine.block_pool.num_free
    engine._forward = _device_lost
    for i in range(UNHEALTHY_FAILED_STEPS):
        rids = [f"r{i}.{j}" for j in range(3)]
        for j, rid in enumerate(rids):
            engine.add_request(rid, _prompt(10 + j, j), GREEDY)
        last = clock.now
        outs = engine.step()
        assert sorted((o.request_id, o.finish_reason, o.error) for o in outs) == [
            (rid, "abort", None) for rid in rids
        ]
        assert engine.recent_failed_steps() == i + 1
        clock.now += 1.0
    assert not engine.has_unfinished() and engine.request_ids() == []
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == start
    clock.now = last + FAILING_WINDOW_S / 2
    assert engine.recent_failed_steps() == UNHEALTHY_FAILED_STEPS
    clock.now = last + FAILING_WINDOW_S
    assert engine.recent_failed_steps() == 0  # old failures: the worker may be tried again


def test_an_error_in_one_requests_bookkeeping_fails_it_alone(llama_dir):
    reference = _run(_engine(llama_dir), _requests(GREEDY))["tokens"]
    engine = _engine(llama_dir)
    append = engine._append_token

    def broken_append(seq, sampled):
        if seq.request_id == "bad" and seq.output_token_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return append(seq, sampled)

    engine._append_token = broken_append
    requests = _requests(GREEDY)
    requests["bad"] = (_prompt(15, 9), GREEDY)
    got = _run(engine, requests)
    assert got["last"]["bad"].finish_reason == "error"
    assert got["last"]["bad"].error.startswith("its step failed: UnicodeDecodeError")
    assert len(got["tokens"]["bad"]) == 1
    assert {rid: got["tokens"][rid] for rid in reference} == reference


def test_min_tokens_with_every_token_stopped_is_refused():
    """A vocabulary small enough for stop_token_ids (with EOS) to cover it
    would leave nothing to sample: such a request is refused up front."""
    params = SamplingParams(min_tokens=1, stop_token_ids=list(range(1, 50)))
    with pytest.raises(ValueError, match="min_tokens with stop_token_ids"):
        params.validate_for_vocab(50, eos_token_ids=[0])
    params.validate_for_vocab(50)  # token 0 is left
    SamplingParams(stop_token_ids=list(range(50))).validate_for_vocab(50)  # no min_tokens


# ---- the sampler alone ------------------------------------------------------


def _rows(params: list[SamplingParams]) -> list[SampleRequest]:
    return [SampleRequest(p, [1, 2], [3], make_generator(p)) for p in params]


def _logits(n: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "params", [GREEDY, SEEDED, GREEDY_LOGPROBS], ids=["greedy", "seeded", "logprobs"]
)
def test_the_sampler_gives_a_non_finite_row_an_error_and_the_others_their_tokens(bad, params):
    sampler = Sampler(50, [0])
    for mix in ([params, SEEDED, GREEDY, params], [params] * 4):  # [GREEDY] * 4: the argmax path
        clean = sampler(_logits(4), _rows(mix))
        logits = _logits(4)
        logits[1, 17] = bad
        got = sampler(logits, _rows(mix))
        assert got[1].error == NONFINITE_LOGITS
        assert [t for i, t in enumerate(got) if i != 1] == [
            t for i, t in enumerate(clean) if i != 1
        ]
        assert all(t.error is None for i, t in enumerate(got) if i != 1)


def test_a_row_with_every_token_masked_gets_an_error_not_a_raise():
    sampler = Sampler(50, [0])
    everything = SamplingParams(
        temperature=0.7, seed=3, min_tokens=5, stop_token_ids=list(range(50))
    )
    mix = [SEEDED, everything, GREEDY]
    got = sampler(_logits(3), _rows(mix))
    clean = sampler(_logits(3), _rows([SEEDED, SEEDED, GREEDY]))
    assert got[1].error == NOTHING_TO_SAMPLE
    assert (got[0], got[2]) == (clean[0], clean[2])


# ---- the worker's health ----------------------------------------------------


async def finish_reasons(worker: EngineWorker, requests: list[str]) -> list[str | None]:
    """Add the requests to a started worker's engine at once (one batch), and
    return how each finished."""
    loop = asyncio.get_running_loop()
    done = {rid: loop.create_future() for rid in requests}
    for rid, fut in done.items():
        worker.listen(rid, lambda out, f=fut: out.finished and not f.done() and f.set_result(out))

    def add(engine: LLMEngine) -> None:
        for i, rid in enumerate(requests):
            engine.add_request(rid, _prompt(10 + i, i), GREEDY)

    await worker.loop.acall(add)
    outs = await asyncio.gather(*done.values())
    for rid in requests:
        worker.unlisten(rid)
    return [out.finish_reason for out in outs]


async def fail_steps(worker: EngineWorker, n: int) -> None:
    """``n`` steps of two sequences that raise even alone (a lost device)."""
    forward = worker.engine._forward
    worker.engine._forward = _device_lost
    try:
        for i in range(n):
            assert await finish_reasons(worker, [f"lost{i}.a", f"lost{i}.b"]) == ["abort"] * 2
    finally:
        worker.engine._forward = forward


def test_a_worker_whose_steps_keep_failing_answers_failing_while_they_are_recent(llama_dir):
    async def main() -> list[tuple[int, bool]]:
        worker = EngineWorker("w", EngineConfig(model=str(llama_dir), num_kv_blocks=64))
        worker.engine.clock = clock = Clock()
        answers = []
        worker.start_loop()
        try:
            for _ in range(UNHEALTHY_FAILED_STEPS):
                await fail_steps(worker, 1)
                health = await worker.health()
                answers.append((health.failed_steps, health.failing))
            clock.now += FAILING_WINDOW_S  # idle since: no step could have passed
            health = await worker.health()
            answers.append((health.failed_steps, health.failing))
            assert await finish_reasons(worker, ["good"]) == ["length"]
            assert worker.stats().idle
        finally:
            worker.stop_loop()
        return answers

    answers = asyncio.run(main())
    assert answers[:-1] == [
        (i + 1, i + 1 >= UNHEALTHY_FAILED_STEPS) for i in range(UNHEALTHY_FAILED_STEPS)
    ]
    assert answers[-1] == (0, False)


def test_single_request_faults_never_make_a_worker_failing(llama_dir):
    """An idle worker gets one request at a time, each of whose steps raises:
    each request fails (its fault), the worker stays healthy."""

    async def main() -> list[tuple[str | None, int, bool]]:
        worker = EngineWorker("w", EngineConfig(model=str(llama_dir), num_kv_blocks=64))
        answers = []
        worker.start_loop()
        try:
            worker.engine._forward = _device_lost
            for i in range(UNHEALTHY_FAILED_STEPS + 2):
                (reason,) = await finish_reasons(worker, [f"bad{i}"])
                health = await worker.health()
                answers.append((reason, health.failed_steps, health.failing))
            assert worker.stats().idle
        finally:
            worker.stop_loop()
        return answers

    assert asyncio.run(main()) == [("error", 0, False)] * (UNHEALTHY_FAILED_STEPS + 2)


def test_a_nan_request_under_speculative_decoding_fails_alone(llama_dir):
    """Its rows turn NaN in the first step that verifies proposals for it
    (if it never speculated it would finish "length"); the others get what
    plain decoding gives them."""
    repetitive = [7, 8, 9, 10] * 9  # prompt lookup proposes for it
    requests = {"a": (_prompt(19, 1), GREEDY), "b": (_prompt(40, 2), GREEDY)}
    reference = _run(_engine(llama_dir), requests)["tokens"]
    engine = LLMEngine(
        EngineConfig(
            model=str(llama_dir),
            num_kv_blocks=64,
            speculative=SpeculativeConfig("ngram", num_speculative_tokens=3),
        )
    )
    forward = engine._forward

    def poisoned_forward(batch):
        sample_rows, spec_rows, hidden = forward(batch)
        row = 0
        for item in batch:  # each sequence's rows, in batch order
            seq = item.seq
            if seq.request_id == "bad" and seq.spec_token_ids:  # rows the verify reads
                hidden = hidden.clone()
                hidden[row : row + item.num_tokens] = math.nan
            row += item.num_tokens
        return sample_rows, spec_rows, hidden

    engine._forward = poisoned_forward
    got = _run(engine, {**requests, "bad": (repetitive, GREEDY)})
    assert (got["last"]["bad"].finish_reason, got["last"]["bad"].error) == (
        "error",
        NONFINITE_LOGITS,
    )
    assert len(got["tokens"]["bad"]) >= 1
    assert {rid: got["tokens"][rid] for rid in reference} == reference
    assert engine.speculator.num_proposed > 0


def test_a_request_that_reads_a_bad_kv_block_fails_alone(llama_dir):
    """KV that arrived broken (NaN in one block of an import, as a bad push
    would bring): that request fails, its blocks leave the prefix cache, and
    a request beside it keeps its tokens."""
    prompt, other = _prompt(40, 10), _prompt(24, 11)
    reference = _run(_engine(llama_dir), {"other": (other, GREEDY)})["tokens"]["other"]
    prefill = _engine(llama_dir)
    prefill.add_request("bad", prompt, GREEDY, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    export = prefill.export_kv("bad")
    prefill.release("bad")
    assert export.data is not None and len(export.block_hashes) == 2
    export.data[:, :, 1] = math.nan  # the second block, every layer, K and V

    decoder = _engine(llama_dir)
    start = decoder.block_pool.num_free
    decoder.import_kv(export, GREEDY)
    assert export.block_hashes[1] in decoder.block_pool.cached_hashes()
    decoder.add_request("other", other, GREEDY)
    tokens: dict[str, list[int]] = {"bad": [], "other": []}
    last = {}
    while decoder.has_unfinished():
        for out in decoder.step():
            tokens[out.request_id] += out.new_token_ids
            last[out.request_id] = out
    assert (last["bad"].finish_reason, last["bad"].error) == ("error", NONFINITE_LOGITS)
    assert tokens["other"] == reference
    assert not set(export.block_hashes) & set(decoder.block_pool.cached_hashes())
    assert leftover_holders(decoder.block_pool) == []
    assert decoder.block_pool.num_free == start
    assert leftover_holders(prefill.block_pool) == []
