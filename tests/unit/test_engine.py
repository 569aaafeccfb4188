"""Step-level engine behaviour: KV export/import, prefix cache, aborts,
preemption. Every test checks that no block holder is left in the pool and
that it returns to its starting free count."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.block_pool import Held, Holder, HolderError
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64))


@pytest.fixture(autouse=True)
def pool_returns_to_start(engine):
    before = engine.block_pool.num_free
    yield
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == before


def test_export_import_continues_like_one_engine(engine, llama_dir):
    prompts = {f"r{i}": _prompt(n, i) for i, n in enumerate([7, 33, 70])}
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    alone = _run(engine)

    decoder = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64))
    decoder_free = decoder.block_pool.num_free
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY, prefill_only=True)
    first = _run(engine)  # prefill-only requests stop after one token
    assert all(len(t) == 1 for t in first.values())
    for rid in prompts:
        export = engine.export_kv(rid)
        assert export.layout == decoder.kv_layout
        assert len(export.block_ids) == -(-len(prompts[rid]) // 16)
        engine.release(rid)
        decoder.import_kv(export, GREEDY)
    rest = _run(decoder)
    for rid in prompts:
        assert first[rid] + rest[rid] == alone[rid]
    assert leftover_holders(decoder.block_pool) == []
    assert decoder.block_pool.num_free == decoder_free


def test_import_refuses_a_different_layout(engine, llama_dir):
    other = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=8))
    engine.add_request("x", _prompt(20), GREEDY, prefill_only=True)
    _run(engine)
    export = engine.export_kv("x")
    engine.release("x")
    free = other.block_pool.num_free
    with pytest.raises(ValueError, match="block_size"):
        other.import_kv(export, GREEDY)
    assert leftover_holders(other.block_pool) == []
    assert other.block_pool.num_free == free


def _received(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[Held, list[int]]:
    """Prefill ``prompt`` here, then copy its blocks into fresh ones held by a
    transfer's lease, as a push would: (the lease's blocks, the known tokens)."""
    engine.add_request(rid, prompt, GREEDY, prefill_only=True)
    _run(engine)
    export = engine.export_kv(rid)
    engine.release(rid)
    lease = Holder("lease", f"recv:{rid}#1")
    blocks = engine.block_pool.allocate(lease, len(export.block_ids))
    engine.kv_cache.write_blocks(blocks, export.data)
    return Held(lease, blocks), export.prompt_token_ids + export.output_token_ids


def test_a_prefilled_request_takes_over_its_transfers_blocks(engine):
    prompt = _prompt(40, 3)
    engine.add_request("whole", prompt, GREEDY)
    whole = _run(engine)["whole"]
    held, known = _received(engine, "r", prompt)
    engine.add_prefilled_request("r", prompt, known[len(prompt) :], GREEDY, [held])
    pool = engine.block_pool
    request = engine._seqs["r"].holder
    assert pool.holders() == [request] and pool.held_by(request) == held.block_ids
    with pytest.raises(HolderError, match="holds no blocks"):
        pool.release(held.holder)  # the lease has nothing left to release
    assert known[len(prompt) :] + _run(engine)["r"] == whole


def test_a_refused_prefilled_request_releases_what_it_was_handed(engine):
    prompt = _prompt(40, 4)
    held, known = _received(engine, "r", prompt)
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_prefilled_request("dup", prompt, known[len(prompt) :], GREEDY, [held])
    assert engine.block_pool.holders() == []  # dup is waiting: it holds nothing yet
    engine.abort("dup")
    held, known = _received(engine, "r", prompt)
    short = Held(held.holder, held.block_ids[:-1])
    with pytest.raises(ValueError, match="expected 3"):
        engine.add_prefilled_request("r", prompt, known[len(prompt) :], GREEDY, [short])
    assert engine.block_pool.holders() == [held.holder]  # the block it was not handed
    assert "r" not in engine.request_ids()
    engine.block_pool.release(held.holder)


def test_prefix_cache_reuses_blocks_and_output_is_unchanged(engine):
    shared = _prompt(64, 5)
    engine.add_request("cold", shared + _prompt(9, 6), GREEDY)
    cold = _run(engine)["cold"]
    engine.add_request("warm", shared + _prompt(9, 6), GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 64  # 4 full blocks of the shared prefix
    assert [o.new_token_ids[0] for o in outs] == cold
    # Decode-generated blocks are cached too: prompt + output is a longer prefix.
    engine.add_request("turn2", shared + _prompt(9, 6) + cold + [42], GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens == (64 + 9 + 24) // 16 * 16


def test_abort_frees_blocks_everywhere(engine):
    engine.add_request("waiting", _prompt(40), GREEDY)
    engine.add_request("running", _prompt(40, 1), GREEDY)
    engine.step()
    engine.add_request("prefilled", _prompt(40, 2), GREEDY, prefill_only=True)
    while not any(o.request_id == "prefilled" for o in engine.step()):  # its first token
        pass
    assert engine.export_kv("prefilled", with_data=False).output_token_ids  # held for export
    for rid in ["waiting", "running", "prefilled", "unknown"]:
        assert engine.abort(rid) == (rid != "unknown")
    assert not engine.has_unfinished()


def test_preemption_under_block_pressure_gives_the_same_tokens(llama_dir):
    prompts = {f"p{i}": _prompt(30, i) for i in range(6)}
    big = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=128))
    small = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=12))
    for eng in (big, small):
        for rid, p in prompts.items():
            eng.add_request(rid, p, GREEDY)
    assert _run(small) == _run(big)
    assert small.scheduler.num_preemptions > 0
    assert leftover_holders(small.block_pool) == [] and small.block_pool.num_free == 12


def test_bad_requests_are_refused_with_the_field_named(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("a", [engine.spec.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("a", [1] * engine.max_model_len, GREEDY)
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], GREEDY)
    engine.abort("dup")


def test_stop_token_and_max_tokens_finish_reasons(engine):
    engine.add_request("a", _prompt(10), SamplingParams(temperature=0, max_tokens=5))
    outs = [o for step in iter(engine.step, []) for o in step if o.finished]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 5
    engine.add_request("b", _prompt(10), GREEDY)
    first = _run(engine)["b"]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first[3]])
    engine.add_request("c", _prompt(10), params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.new_token_ids[0] for o in outs] == first[: first.index(first[3]) + 1]
    assert outs[-1].finish_reason == "stop"


def test_a_cache_salt_separates_prefix_cache_domains(engine):
    """Same prompt, two salts: no block of one answers the other's lookup;
    the same salt again hits."""
    prompt = _prompt(64, 11) + _prompt(5, 12)
    engine.add_request("salt-a", prompt, GREEDY, cache_salt=b"tenant-a")
    first = _run(engine)["salt-a"]
    hits = {}
    for rid, salt in (("salt-b", b"tenant-b"), ("plain", b""), ("salt-a-again", b"tenant-a")):
        engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        hits[rid] = outs[0].num_cached_tokens
        assert [o.new_token_ids[0] for o in outs] == first
    assert hits == {"salt-b": 0, "plain": 0, "salt-a-again": 64}
