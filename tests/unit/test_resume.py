"""A request continued from tokens it generated elsewhere (a decode
failover): the rest of its tokens and text equal an undisturbed run, for
greedy and seeded sampled requests, with stop strings and max_tokens
counting the tokens already generated."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine import EngineConfig, LLMEngine
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
N = 24


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)  # text emitted with each token
    finish_reason: str | None = None
    num_output_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.deltas)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(num_kv_blocks=64))


@pytest.fixture(autouse=True)
def pool_returns_to_start(engine):
    before = engine.block_pool.num_free
    yield
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == before
    assert engine.request_ids() == []


def _run(engine: LLMEngine, params: SamplingParams, outputs: list[int] = ()) -> Run:
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("r", ids, params, output_token_ids=outputs)
    run = Run()
    while engine.has_unfinished():
        for out in engine.step():
            run.tokens += out.new_token_ids
            run.deltas += [out.text_delta] * len(out.new_token_ids)
            run.finish_reason = out.finish_reason
            run.num_output_tokens = out.num_output_tokens
    return run


@pytest.mark.parametrize("k", [1, 5, 17, N - 1])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_resumed_equals_undisturbed(engine, k, sampling):
    if sampling == "greedy":
        params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    else:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=N, ignore_eos=True)
    full = _run(engine, params)
    assert len(full.tokens) == N
    rest = _run(engine, params, full.tokens[:k])
    assert full.tokens[:k] + rest.tokens == full.tokens
    assert "".join(full.deltas[:k]) + rest.text == full.text
    assert rest.finish_reason == "length"
    assert rest.num_output_tokens == N  # max_tokens counts the tokens generated before


def test_seeded_draws_depend_on_seed_and_position_only(engine):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=N, ignore_eos=True)
    a, b = _run(engine, params), _run(engine, params)
    assert a.tokens == b.tokens
    other = _run(engine, SamplingParams(temperature=1.0, seed=4, max_tokens=N, ignore_eos=True))
    assert other.tokens != a.tokens


def test_stop_string_across_the_resume_point(engine):
    greedy = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    plain = _run(engine, greedy)
    # A stop string that starts in the text of the first k tokens and ends after it.
    k = 8
    before = "".join(plain.deltas[:k])
    stop = plain.text[len(before) - 2 : len(before) + 3]
    assert len(stop) == 5 and stop in plain.text
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop])
    full = _run(engine, params)
    assert full.finish_reason == "stop" and stop not in full.text
    resume_at = min(k, len(full.tokens) - 1)
    rest = _run(engine, params, full.tokens[:resume_at])
    assert full.tokens[:resume_at] + rest.tokens == full.tokens
    assert "".join(full.deltas[:resume_at]) + rest.text == full.text
    assert rest.finish_reason == "stop"


def test_outputs_that_reach_max_tokens_are_refused(engine):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = engine.tokenizer.encode(PROMPT)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("r", ids, params, output_token_ids=[11, 12, 13, 14])
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("r", ids, params, output_token_ids=[10**7])
    assert engine.request_ids() == []
