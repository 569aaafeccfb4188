"""Speculative decoding inside the engine: greedy output equals plain
decoding with every proposer, stops land where plain decoding puts them,
acceptance counters, and every pool (target and draft) back to its start."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.block_pool import Holder
from engine.config import SpeculativeConfig
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(checkpoint_factory):
    """A smaller model with the same tokenizer (vocabulary)."""
    return checkpoint_factory("llama", num_hidden_layers=1, hidden_size=64, intermediate_size=128)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 5000, (n,), generator=gen).tolist() for n in (5, 19, 40)]
    return [*prompts, [7, 8, 9, 10] * 9]  # repetitive: prompt lookup finds matches


def _engine(model, spec: SpeculativeConfig | None, **options) -> LLMEngine:
    options.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=str(model), speculative=spec, **options))


def _run(engine: LLMEngine, prompts, params) -> dict[str, dict]:
    """Run to completion; check no pool has a holder left and each is back to its start."""
    free = engine.block_pool.num_free
    draft = getattr(engine.speculator, "proposer", None)
    draft_free = getattr(draft, "num_free_blocks", None)
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, per_prompt, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    out: dict[str, dict] = {}
    while engine.has_unfinished():
        for o in engine.step():
            r = out.setdefault(o.request_id, {"ids": [], "text": "", "lp": [], "reason": None})
            r["ids"] += o.new_token_ids
            r["text"] += o.text_delta
            r["lp"] += [x.logprob for x in o.logprobs or []]
            r["reason"] = o.finish_reason
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == free
    if draft_free is not None:
        assert leftover_holders(draft.pool) == []
        assert draft.num_free_blocks == draft_free
    return out


@pytest.fixture(scope="module")
def plain(llama_dir):
    return _engine(llama_dir, None)


@pytest.fixture(scope="module")
def baseline(plain):
    return _run(plain, _prompts(), GREEDY)


def test_ngram_greedy_equals_plain_decoding(llama_dir, baseline):
    engine = _engine(llama_dir, SpeculativeConfig("ngram", num_speculative_tokens=3))
    assert _run(engine, _prompts(), GREEDY) == baseline
    s = engine.speculator
    assert s.num_proposed > 0 and 0 < s.num_accepted <= s.num_proposed
    assert s.num_emitted > s.num_accepted  # one corrected or bonus token per step


def test_draft_equal_to_target_accepts_everything(llama_dir, baseline):
    engine = _engine(llama_dir, SpeculativeConfig("draft", 4, draft_model=str(llama_dir)))
    assert engine.speculator.proposer.model.screen_head is None  # it only reads logits
    assert _run(engine, _prompts(), GREEDY) == baseline
    s = engine.speculator
    assert s.num_proposed > 0 and s.num_accepted == s.num_proposed
    # Each speculative step emits the accepted proposals plus one token.
    assert s.num_emitted - s.num_accepted < sum(len(r["ids"]) for r in baseline.values()) / 3


def test_a_different_draft_gives_identical_output(llama_dir, draft_dir, baseline):
    engine = _engine(llama_dir, SpeculativeConfig("draft", 3, draft_model=str(draft_dir)))
    assert _run(engine, _prompts(), GREEDY) == baseline
    s = engine.speculator
    assert s.num_proposed > 0
    # A random draft is (almost) never right: sequences back off instead of
    # verifying k + 1 tokens every step.
    decode_tokens = sum(len(r["ids"]) - 1 for r in baseline.values())
    assert s.num_accepted < s.num_proposed / 4
    assert s.num_emitted - s.num_accepted <= decode_tokens / 3  # steps that speculated


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stops_land_where_plain_decoding_puts_them(llama_dir, plain, baseline, method):
    """max_tokens, stop token ids and stop strings hit inside a run of
    accepted tokens end the request at the same token, with the same text."""
    ids = baseline["r1"]["ids"]
    text = plain.tokenizer.decode(ids[:12])
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[9]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=[text[-6:]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
    ]
    prompts = [_prompts()[1]] * 4
    expected = _run(plain, prompts, params)
    spec = SpeculativeConfig(method, 4, draft_model=str(llama_dir))
    got = _run(_engine(llama_dir, spec), prompts, params)
    assert [r["ids"] for r in got.values()] == [r["ids"] for r in expected.values()]
    assert [r["text"] for r in got.values()] == [r["text"] for r in expected.values()]
    assert [r["reason"] for r in got.values()] == [r["reason"] for r in expected.values()]
    assert len(got["r0"]["ids"]) == 7 and got["r1"]["reason"] == "stop"
    torch.testing.assert_close(got["r3"]["lp"], expected["r3"]["lp"], atol=1e-4, rtol=0)


def test_penalised_requests_decode_without_speculation(llama_dir, plain):
    params = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, ignore_eos=True)
    prompts = _prompts()[3:]
    engine = _engine(llama_dir, SpeculativeConfig("draft", 3, draft_model=str(llama_dir)))
    assert _run(engine, prompts, params) == _run(plain, prompts, params)
    assert engine.speculator.num_proposed == 0


@pytest.mark.slow
def test_small_token_budget_and_block_pressure(llama_dir, baseline):
    """The token budget cuts proposals; a small pool preempts and recomputes.
    Output is unchanged either way."""
    spec = SpeculativeConfig("draft", 4, draft_model=str(llama_dir))
    engine = _engine(llama_dir, spec, max_num_batched_tokens=6)
    assert _run(engine, _prompts(), GREEDY) == baseline
    engine = _engine(llama_dir, spec, num_kv_blocks=9)
    assert _run(engine, _prompts(), GREEDY) == baseline
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_sampled_requests_with_speculation_finish_and_free_everything(llama_dir, draft_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, seed=3, ignore_eos=True)
    for model in (llama_dir, draft_dir):
        engine = _engine(llama_dir, SpeculativeConfig("draft", 3, draft_model=str(model)))
        out = _run(engine, _prompts(), params)
        assert all(len(r["ids"]) == 25 for r in out.values())
        assert engine.speculator.num_proposed > 0
        again = _engine(llama_dir, SpeculativeConfig("draft", 3, draft_model=str(model)))
        assert _run(again, _prompts(), params) == out  # seeded: reproducible


def test_abort_mid_speculation_frees_target_and_draft_blocks(llama_dir):
    engine = _engine(llama_dir, SpeculativeConfig("draft", 3, draft_model=str(llama_dir)))
    draft = engine.speculator.proposer
    free, draft_free = engine.block_pool.num_free, draft.num_free_blocks
    for i, p in enumerate(_prompts()):
        engine.add_request(f"a{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    assert draft.num_free_blocks < draft_free
    for rid, state in draft._states.items():  # each request's draft blocks, by its holder
        assert draft.pool.held_by(Holder("draft", rid)) == state.block_table
    assert {h.kind for h in draft.pool.holders()} == {"draft"}
    for i in range(len(_prompts())):
        engine.abort(f"a{i}")
    assert leftover_holders(engine.block_pool) == leftover_holders(draft.pool) == []
    assert engine.block_pool.num_free == free
    assert draft.num_free_blocks == draft_free


def test_draft_with_another_vocabulary_is_refused(llama_dir, checkpoint_factory):
    other = checkpoint_factory("llama", vocab_size=40000)
    with pytest.raises(ValueError, match="tokenizer"):
        _engine(llama_dir, SpeculativeConfig("draft", 2, draft_model=str(other)))


def test_config_is_checked():
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", num_speculative_tokens=0)


def test_worker_stats_count_acceptance_and_quantized_store(llama_dir):
    from kv_transfer.quantized import QuantizedBlockStore
    from worker.base import EngineWorker

    config = EngineConfig(
        model=str(llama_dir),
        num_kv_blocks=64,
        speculative=SpeculativeConfig("ngram", 3),
        kv_transfer_dtype="int8",
    )
    worker = EngineWorker("w", config)
    assert isinstance(worker.store, QuantizedBlockStore)
    assert worker.store.layout.wire_dtype == "int8"
    assert worker.stats().spec_proposed_tokens == 0
    _run(worker.engine, _prompts()[3:], GREEDY)
    stats = worker.stats()
    assert stats.spec_accepted_tokens == worker.engine.speculator.num_accepted > 0
    assert stats.spec_proposed_tokens >= stats.spec_accepted_tokens
    assert stats.free_blocks == stats.initial_free_blocks
    assert stats.num_holders == stats.initial_num_holders == 0


def test_serve_config_enables_speculation_in_the_decode_pool_only():
    from router.config import ServeConfig

    config = ServeConfig(
        speculative={"method": "ngram", "num_speculative_tokens": 3}, transfer={"dtype": "fp8"}
    )
    decode = config.engine_config("decode", 0)
    assert decode.speculative == SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=4)
    prefill = config.engine_config("prefill", 0)
    assert prefill.speculative is None
    assert decode.kv_transfer_dtype == prefill.kv_transfer_dtype == "fp8"
    draft = ServeConfig(speculative={"method": "draft", "draft_model": "/d", "ngram_max": 6})
    assert draft.engine_config("colocated", 0).speculative == SpeculativeConfig(
        "draft", 4, ngram_max=6, ngram_min=1, draft_model="/d"
    )
    # The engine's own checks are the section's: a ValueError (pydantic's) naming the section.
    with pytest.raises(ValueError, match=r"speculative\n.*draft_model"):
        ServeConfig(speculative={"method": "draft"})
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        ServeConfig(speculative={"method": "ngram", "ngram_min": 5})


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_rejected_positions_give_their_blocks_back_every_step(llama_dir, draft_dir, method):
    """After each step a sequence holds blocks for its computed tokens only, and
    the pool's holders are exactly the running sequences, each holding its
    block table."""
    engine = _engine(llama_dir, SpeculativeConfig(method, 4, draft_model=str(draft_dir)))
    bs = engine.config.block_size
    for i, p in enumerate(_prompts()):
        engine.add_request(f"s{i}", p, GREEDY)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        held = set()
        pool = engine.block_pool
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == -(-seq.num_computed // bs)
            assert not seq.spec_token_ids
            assert pool.held_by(seq.holder) == seq.block_table
            held.update(seq.block_table)
        assert set(leftover_holders(pool)) == {s.holder for s in engine.scheduler.running}
        assert pool.num_blocks - pool.num_free == len(held)
    s = engine.speculator
    assert s.num_proposed > s.num_accepted  # there were rejections
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
