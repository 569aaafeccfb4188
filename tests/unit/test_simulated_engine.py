"""The simulated model (engine/simulated.py) inside the real engine, and the
profiles it runs (planner/profile.py, planner/profiles/): tokens are a
function of the context read back from the KV blocks, so chunking, prefix
hits, KV export/import and resumes give the same tokens, and a wrong block
gives others; each step asks for the profile's time."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine
from planner import published
from planner.profile import Profile, fit_decode, fit_prefill
from planner.profiles import load_profile, profile_names
from protocol.sampling import SamplingParams
from router.config import ServeConfig
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

PROFILE = "llama-3.1-8b-h200"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = {"simulate": PROFILE, "num_kv_blocks": 128}


def _prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128256, (n,), generator=gen).tolist()


PROMPTS = [_prompt(n, i) for i, n in enumerate([5, 16, 40, 123])]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [o.token_ids for o in LLM(**SMALL).generate(PROMPTS, GREEDY)]


def test_tokens_are_deterministic_and_depend_on_the_context(reference):
    again = [o.token_ids for o in LLM(**SMALL).generate(PROMPTS, GREEDY)]
    assert again == reference
    assert all(len(t) == GREEDY.max_tokens for t in reference)
    assert len({tuple(t) for t in reference}) == len(PROMPTS)
    one_changed = [*PROMPTS[3][:50], PROMPTS[3][50] + 1, *PROMPTS[3][51:]]
    (changed,) = LLM(**SMALL).generate([one_changed], GREEDY)
    assert changed.token_ids != reference[3]  # a token far back changes what follows


def test_sampling_parameters_do_not_change_the_tokens(reference):
    params = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=12, ignore_eos=True, seed=3)
    outs = LLM(**SMALL).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == reference


def test_chunked_prefill_and_prefix_hits_give_the_same_tokens(reference):
    chunked = LLM(**SMALL, max_num_batched_tokens=7)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == reference
    second = chunked.generate(PROMPTS, GREEDY)  # their full blocks are cached now
    assert [o.token_ids for o in second] == reference
    assert second[3].num_cached_tokens == 112


def test_export_import_continues_like_one_engine(reference):
    prefill, decode = LLMEngine(EngineConfig(**SMALL)), LLMEngine(EngineConfig(**SMALL))
    for i, p in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", p, GREEDY, prefill_only=True)
    first = _run(prefill)
    for i in range(len(PROMPTS)):
        decode.import_kv(prefill.export_kv(f"r{i}"), GREEDY)
        prefill.release(f"r{i}")
    rest = _run(decode)
    assert [first[f"r{i}"] + rest[f"r{i}"] for i in range(len(PROMPTS))] == reference
    for engine in (prefill, decode):
        assert leftover_holders(engine.block_pool) == []


def test_a_wrong_block_changes_the_output(reference):
    prefill, decode = LLMEngine(EngineConfig(**SMALL)), LLMEngine(EngineConfig(**SMALL))
    prefill.add_request("r", PROMPTS[3], GREEDY, prefill_only=True)
    first = _run(prefill)["r"]
    export = prefill.export_kv("r")
    prefill.release("r")
    assert export.data is not None
    export.data[:, :, 0] = 0  # the first block arrives zeroed
    decode.import_kv(export, GREEDY)
    rest = _run(decode)["r"]
    assert first == reference[3][:1]
    assert rest != reference[3][1:]


def test_a_resumed_request_goes_on_with_the_same_tokens(reference):
    engine = LLMEngine(EngineConfig(**SMALL))
    engine.add_request("r", PROMPTS[2], GREEDY, output_token_ids=reference[2][:5])
    assert _run(engine)["r"] == reference[2][5:]


class FakeTime:
    """A clock that only sleeping moves (and ``spend``)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.asked: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        self.now += seconds

    def spend(self, seconds: float) -> None:
        self.now += seconds


def _timed_engine() -> tuple[LLMEngine, FakeTime]:
    engine, fake = LLMEngine(EngineConfig(**SMALL)), FakeTime()
    assert engine.simulated is not None
    engine.simulated.clock, engine.simulated.sleep = fake.clock, fake.sleep
    return engine, fake


def test_each_step_asks_for_the_profiles_time():
    engine, fake = _timed_engine()
    asked = fake.asked
    engine.add_request("a", PROMPTS[2], GREEDY)
    engine.add_request("b", PROMPTS[3], GREEDY)
    engine.step()  # both prompts in one step
    profile = load_profile(PROFILE)
    assert asked == [pytest.approx(profile.prefill_s([40, 123]))]
    engine.step()  # both decode: contexts 41 and 124
    assert asked[1] == pytest.approx(profile.decode_step_s(2, (41 + 124) / 2))
    _run(engine)
    contexts = [(41 + i + 124 + i) / 2 for i in range(GREEDY.max_tokens - 1)]
    assert asked[1:] == [pytest.approx(profile.decode_step_s(2, c)) for c in contexts]


def test_work_between_busy_steps_counts_in_the_next_one():
    engine, fake = _timed_engine()
    profile = load_profile(PROFILE)
    engine.add_request("a", PROMPTS[2], GREEDY)
    engine.step()
    fake.spend(0.001)  # publishing the outputs, less than a step
    engine.step()
    assert fake.asked[1] == pytest.approx(profile.decode_step_s(1, 41) - 0.001)
    fake.spend(1.0)  # idle: the next step starts afresh
    engine.step()
    assert fake.asked[2] == pytest.approx(profile.decode_step_s(1, 42))
    engine.abort("a")


def test_a_step_after_an_idle_gap_takes_its_whole_time():
    engine, fake = _timed_engine()
    profile = load_profile(PROFILE)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("a", PROMPTS[1], one)
    engine.step()  # its one token: the engine is idle after this step
    assert not engine.has_unfinished()
    prefill = profile.prefill_s([40])
    fake.spend(prefill / 2)  # a request arrives within one step's time of the last end
    engine.add_request("b", PROMPTS[2], GREEDY)
    engine.step()
    assert fake.asked[1] == pytest.approx(prefill)  # counted from now, not the last end
    engine.abort("b")


def test_the_pool_holds_the_profiled_models_tokens():
    engine = LLMEngine(EngineConfig(simulate=PROFILE, kv_cache_memory_bytes=1 << 30))
    per_block = load_profile(PROFILE).kv_bytes_per_token * 16
    assert engine.block_pool.num_blocks == (1 << 30) // per_block
    assert engine.kv_layout.block_bytes == 16 * 2 * 4 * 4  # what really moves: 32 B a token


@pytest.mark.parametrize(
    "options",
    [{"speculative": {}}, {"dtype": "bfloat16"}, {"kv_transfer_dtype": "int8"}],
    ids=["speculative", "bfloat16", "int8-transfer"],
)
def test_what_is_not_simulated_is_refused(options):
    from engine.config import SpeculativeConfig

    if "speculative" in options:
        options = {"speculative": SpeculativeConfig()}
    with pytest.raises(ValueError, match="simulate"):
        EngineConfig(simulate=PROFILE, **options)


def test_the_serve_config_passes_simulate_to_every_worker():
    config = ServeConfig(engine={"simulate": PROFILE})
    assert config.engine_config("prefill", 0).simulate == PROFILE
    assert config.served_name() == f"simulated-{PROFILE}"


# ---- profiles ----------------------------------------------------------------


def test_a_version_1_profile_loads_and_simulates(tmp_path):
    path = tmp_path / "measured.json"
    data = {"prefill": {"a": 1e-3, "b": 1e-6, "c": 0.0}, "decode": {"d": 2e-3, "e": 1e-5, "f": 0.0}}
    path.write_text(json.dumps({**data, "vocab_size": 500, "kv_bytes_per_token": 4096}))
    profile = load_profile(path)
    assert (profile.version, profile.source) == (1, "measured")
    (out,) = LLM(simulate=str(path), num_kv_blocks=32).generate([[1, 2, 3]], GREEDY)
    assert len(out.token_ids) == 12 and all(0 <= t < 500 for t in out.token_ids)


def test_what_the_profiler_saves_runs_simulated(tmp_path):
    """The path of `tandem plan --profile-out`: fitted samples, Profile.save."""
    prefill, r2p = fit_prefill([([32], 0.01), ([256], 0.05), ([32] * 4, 0.03), ([1024], 0.3)])
    decode, r2d = fit_decode([(1, 64, 0.01), (16, 64, 0.02), (1, 1024, 0.015), (16, 1024, 0.05)])
    measured = Profile(prefill, decode, kv_bytes_per_token=4096, vocab_size=300, model="m")
    measured.fit_quality = {"prefill_r2": r2p, "decode_r2": r2d}
    path = tmp_path / "profile.json"
    measured.save(path)
    assert load_profile(path) == measured
    llm = LLM(simulate=str(path), num_kv_blocks=32)
    (out,) = llm.generate([[1, 2, 3]], GREEDY)
    assert len(out.token_ids) == 12 and all(0 <= t < 300 for t in out.token_ids)


def test_the_shipped_measured_profile_runs_simulated():
    profile = load_profile("smollm2-135m-cpu")
    assert profile.source.startswith("measured") and profile.prefill_samples
    (out,) = LLM(simulate="smollm2-135m-cpu", num_kv_blocks=16).generate([[5, 6]], GREEDY)
    assert all(0 <= t < profile.vocab_size for t in out.token_ids)


def test_a_newer_format_is_refused(tmp_path):
    path = tmp_path / "future.json"
    data = json.loads(load_profile(PROFILE).to_json())
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        load_profile(path)


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError) as err:
        load_profile("no-such-profile")
    assert all(name in str(err.value) for name in profile_names())


def test_the_shipped_profiles_are_what_their_derivation_gives():
    names = profile_names()
    assert {p().name for p in published.PUBLISHED} | {"smollm2-135m-cpu"} == set(names)
    for make in published.PUBLISHED:
        derived = make()
        shipped = load_profile(derived.name)
        assert shipped == Profile.from_dict(json.loads(derived.to_json()))
        assert "https://" in shipped.source and shipped.hardware and shipped.notes


def test_a_mixed_step_counts_the_fixed_cost_once():
    p = load_profile(PROFILE)
    mixed = p.step_s([100], [0], 4, 500.0)
    assert mixed == pytest.approx(p.prefill_s([100]) + p.decode_step_s(4, 500.0) - p.decode["d"])
    assert p.prefill_s([10], [90]) > p.prefill_s([10])  # a chunk after cached context


def test_plan_lists_the_shipped_profiles(capsys):
    from tandem_cli.main import main

    assert main(["plan", "--profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == profile_names()
    assert all("https://" in line or "measured" in line for line in lines)


def test_serve_takes_simulate_from_its_flag():
    from tandem_cli.main import build_parser
    from tandem_cli.serve import SERVE_FLAGS

    args = build_parser().parse_args(["serve", "--simulate", PROFILE])
    flags = {path: getattr(args, dest) for dest, path in SERVE_FLAGS.items()}
    assert ServeConfig.load(None, flags).engine.simulate == PROFILE
