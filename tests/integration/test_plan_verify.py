"""The planner's model against replays of the same traces on a deployment of
simulated workers (1 prefill + 1 decode, steps of tens to hundreds of ms, a
decode pool that holds four requests). Each load is one the model gets
wrong by far more than the tolerance if it leaves out what the test is
about: the prefill queue of a burst, the wait for KV room, the decode batch.
Then `tandem plan --verify-target` on a saved trace, end to end."""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import replace

import pytest

from planner.calibrate import Calibration, fit, probe_trace
from planner.predict import Prediction
from planner.profile import Profile
from planner.settings import system_for
from planner.simulator import UNLIMITED_BLOCKS, simulate
from planner.trace import Trace, TraceRequest
from planner.verify import compare, replay
from router.config import ServeConfig
from tandem_cli.main import main
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

VOCAB = 5000
PROFILE = {
    "prefill": {"a": 0.02, "b": 1e-4, "c": 0.0},  # 512 tokens: 71 ms a step
    "decode": {"d": 0.03, "e": 1e-3, "f": 0.0},  # batch 4: 34 ms a step
    "kv_bytes_per_token": 65536,  # 1 MiB a block of 16
    "vocab_size": VOCAB,
    "max_model_len": 4096,
}
KV_MB = 300  # 300 blocks a worker: four requests of 1024 + 40 tokens (67 blocks each)
TOLERANCE = 0.25  # where the effect tested is small: TPOT by decode batch (~10%)
# Where the effect is a queue (2-5x), a wider band: the machine is shared, and
# on a loaded one the same comparisons missed by 40% and more (steps run late),
# while a flaky failure blocks CI. Each such test also shows that the model
# without the effect misses the measurement by more than this (``_outside``).
WIDE = 0.4
TTFT = ("ttft_p50", "ttft_p90")
TPOT = ("tpot_p50", "tpot_p90")


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


@pytest.fixture(scope="module")
def config(profile_file) -> ServeConfig:
    return ServeConfig(
        engine={"simulate": str(profile_file), "kv_cache_memory_mb": KV_MB},
        pools={"prefill": 1, "decode": 1, "cpu_binding": False},
        transfer={"lease_s": 120},
    )


@pytest.fixture(scope="module")
def deployment(ray_cluster, config):
    with deployed(config) as d:
        warm = _trace("warm-up", [0.0, 0.05], 600, 8, seed=99)  # first connections, first steps
        asyncio.run(replay(d.address, warm))
        yield d


def _trace(name: str, arrivals: list[float], prompt_len: int, output_len: int, seed: int):
    rng = random.Random(seed)
    reqs = tuple(
        TraceRequest(t, tuple(rng.choices(range(1, VOCAB), k=prompt_len)), output_len)
        for t in arrivals
    )
    return Trace(name, reqs)


@pytest.fixture(scope="module")
def calibration(deployment, config) -> Calibration:
    """The path's costs outside the steps, from a short idle probe."""
    profile = Profile.from_dict(PROFILE)
    system = system_for(config, profile.kv_bytes_per_token, simulated=True)
    probe = probe_trace(VOCAB, gap_s=0.8, output_len=12, lengths=(64, 1024))
    cal = fit(system, profile, probe, asyncio.run(replay(deployment.address, probe)))
    assert 0 <= cal.fixed_s < 0.2 and -0.002 < cal.step_s < 0.01, cal
    return cal


def _model(config, calibration, trace, **changes):
    profile = Profile.from_dict(PROFILE)
    system = system_for(config, profile.kv_bytes_per_token, simulated=True)
    system = replace(calibration.apply(system), **changes)
    res = simulate(trace, system, profile.prefill_s, profile.decode_step_s,
                   step_cost=profile.step_s)  # fmt: skip
    return Prediction.of(res)


def _check(name, predicted, measured, metrics=TTFT + TPOT, tolerance=TOLERANCE):
    c = compare(name, predicted, measured)
    print(c.table())
    assert measured.errors == 0
    bad = {k: round(c.error[k], 3) for k in metrics if abs(c.error[k]) > tolerance}
    assert not bad, c.table()
    return c


def _outside(name, without, measured, metrics=TTFT):
    """The model without the effect tested (``without``) misses the
    measurement by more than WIDE in one of ``metrics``: the wide band still
    fails a model that leaves the effect out."""
    c = compare(name, without, measured)
    print(c.table())
    assert max(abs(c.error[k]) for k in metrics) > WIDE, c.table()


def test_a_burst_queues_at_the_prefill_worker(deployment, config, calibration):
    # 6 prompts of 1024 tokens at once: two 71-ms steps each, one after the
    # other: first tokens at ~0.15, 0.3, ... 0.9 s.
    trace = _trace("burst", [0.01 * i for i in range(6)], 1024, 4, seed=1)
    measured = asyncio.run(replay(deployment.address, trace))
    predicted = _model(config, calibration, trace)
    _check("burst", predicted, measured, TTFT, WIDE)
    assert predicted.ttft_p90 > 4 * predicted.ttft_p50 / 3  # the queue is most of it
    # Without the queue: a prefill worker for each request.
    alone = _model(config, calibration, trace, num_prefill=len(trace.requests))
    _outside("burst, no prefill queue", alone, measured)


def test_a_full_decode_pool_makes_requests_wait_for_room(deployment, config, calibration):
    # 8 requests of 1024 + 40 tokens, one every 50 ms: four fit on the decode
    # worker; the others wait until one ends (~1.4 s of decode).
    trace = _trace("kv-full", [0.05 * i for i in range(8)], 1024, 40, seed=2)
    measured = asyncio.run(replay(deployment.address, trace))
    predicted = _model(config, calibration, trace)
    _check("kv-full", predicted, measured, TTFT, WIDE)
    _check("kv-full", predicted, measured, TPOT)
    assert predicted.mean_admission_wait_s > 0.3
    # Without the pool's limit: no wait for room.
    unlimited = _model(config, calibration, trace, decode_kv_blocks=UNLIMITED_BLOCKS)
    _outside("kv-full, unlimited pool", unlimited, measured)


def test_tpot_follows_the_decode_batch(deployment, config, calibration):
    # 4 short prompts together decode as a batch of 4 (34 ms a step), a lone
    # one later as a batch of 1 (31 ms); 3 more fill the batch again.
    arrivals = [0.0, 0.0, 0.0, 0.0, 3.0, 6.0, 6.0, 6.0]
    trace = _trace("batch", arrivals, 64, 30, seed=3)
    measured = asyncio.run(replay(deployment.address, trace))
    _check("batch", _model(config, calibration, trace), measured, ("tpot_p50", "tpot_p90"))


def test_plan_verify_target_prints_predicted_against_measured(
    deployment, profile_file, tmp_path, capsys
):
    trace = _trace("cli", [0.3 * i for i in range(10)], 1024, 16, seed=4)
    path = tmp_path / "trace.json"
    trace.save(path)
    code = main(
        [
            "plan", "--profile", str(profile_file), "--trace", str(path),
            "--slo", "ttft_ms=2000,tpot_ms=200", "--max-workers", "2",
            "--verify-target", deployment.address, "--verify-pools", "1:1",
            "--verify-requests", "10",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"verify: measured attainment [\d.]+% \(predicted [\d.]+%\), 0 errors", out)
    rows = dict(re.findall(r"^\s+(\w+_p\d0) ms\s+[\d.]+\s+[\d.]+\s+([+-][\d.]+)%", out, re.M))
    assert set(rows) == {"ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"}, out
    assert abs(float(rows["ttft_p50"])) <= TOLERANCE * 100, out
    assert abs(float(rows["tpot_p50"])) <= TOLERANCE * 100, out
