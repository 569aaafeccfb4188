"""The planner: simulator against closed-form queueing results, the fits,
the search on a synthetic profile where the answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from planner.profile import Profile, fit_decode, fit_prefill
from planner.search import naive_split, search
from planner.simulator import SystemConfig, Workload, simulate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_prefill_worker_matches_md1_waiting_time(rho):
    service = 0.1
    rate = rho / service
    res = simulate(
        Workload(rate=rate, input_len=(100, 100), output_len=(1, 1), num_requests=40_000),
        SystemConfig(1, 1, prefill_token_budget=0),  # no batching
        lambda lengths: service * len(lengths),
        lambda batch, ctx: 0.01,
        seed=7,
    )
    expected = rho * service / (2 * (1 - rho))  # M/D/1 mean wait in queue
    assert res.mean_queue_wait == pytest.approx(expected, rel=0.08)
    # TTFT is the wait plus the service time.
    assert float(res.ttft.mean()) == pytest.approx(expected + service, rel=0.08)


def test_simulation_is_deterministic_for_a_seed():
    args = (
        Workload(rate=5, input_len=(32, 512), output_len=(4, 32), num_requests=300),
        SystemConfig(2, 2),
        lambda ls: 0.001 + 1e-4 * sum(ls),
        lambda b, c: 0.002 + 1e-4 * b,
    )
    a = simulate(*args, seed=3)
    b = simulate(*args, seed=3)
    c = simulate(*args, seed=4)
    assert np.array_equal(a.ttft, b.ttft) and np.array_equal(a.tpot, b.tpot)
    assert not np.array_equal(a.ttft, c.ttft)


def test_isolated_requests_get_tpot_equal_to_the_step_time():
    step = 0.02
    res = simulate(
        Workload(rate=0.05, input_len=(64, 64), output_len=(10, 10), num_requests=50),
        SystemConfig(1, 1, kv_latency_s=0.0),
        lambda ls: 0.01,
        lambda b, c: step,
        seed=1,
    )
    assert np.allclose(res.tpot, step)


def test_batched_decode_with_constant_step_time_is_within_one_join_wait():
    step, n = 0.02, 10
    res = simulate(
        Workload(rate=40, input_len=(64, 64), output_len=(n, n), num_requests=500),
        SystemConfig(1, 1, kv_latency_s=0.0),
        lambda ls: 0.001,
        lambda b, c: step,
        seed=1,
    )
    # A sequence waits less than one step to join, then gets one token per step.
    assert res.tpot.min() >= step - 1e-12
    assert res.tpot.max() <= step * (1 + 1 / (n - 1)) + 1e-12
    assert res.attainment == 1.0  # no SLOs given: everything meets them


def test_prefill_batching_respects_the_token_budget():
    seen = []

    def cost(lengths):
        seen.append(list(lengths))
        return 0.5

    simulate(
        Workload(rate=100, input_len=(300, 300), output_len=(1, 1), num_requests=200),
        SystemConfig(1, 1, prefill_token_budget=1000),
        cost,
        lambda b, c: 0.01,
    )
    # Chunked prefill, as the engine: a busy step fills the budget exactly,
    # 3 whole prompts and a 100-token chunk of the fourth.
    assert all(sum(b) <= 1000 for b in seen)
    assert [300, 300, 300, 100] in seen


def test_fit_prefill_recovers_synthetic_coefficients():
    a, b, c = 0.004, 1.5e-4, 5e-8
    batches = [[n] * k for n in (32, 128, 512, 1024) for k in (1, 2, 4)]
    samples = [(ls, a + b * sum(ls) + c * sum(x * x for x in ls)) for ls in batches]
    coef, r2 = fit_prefill(samples)
    assert coef == pytest.approx({"a": a, "b": b, "c": c}, rel=1e-6)
    assert r2 == pytest.approx(1.0)


def test_fit_decode_recovers_synthetic_coefficients():
    d, e, f = 0.003, 4e-4, 5e-9
    samples = [(bt, ctx, d + e * bt + f * bt * ctx) for bt in (1, 8, 64) for ctx in (64, 1024)]
    coef, r2 = fit_decode(samples)
    assert coef == pytest.approx({"d": d, "e": e, "f": f}, rel=1e-6)
    assert r2 == pytest.approx(1.0)


def test_fit_drops_a_negative_quadratic_term():
    samples = [([n], 0.01 + 1e-4 * n - 1e-9 * n * n) for n in (32, 256, 1024, 2048)]
    coef, _ = fit_prefill(samples)
    assert coef["c"] == 0.0 and coef["b"] > 0


def test_profile_round_trips_through_json(tmp_path):
    p = Profile(
        prefill={"a": 0.01, "b": 1e-4, "c": 0.0},
        decode={"d": 0.002, "e": 1e-4, "f": 0.0},
        kv_bytes_per_token=4096,
    )
    path = tmp_path / "p.json"
    p.save(path)
    q = Profile.load(path)
    assert q == p
    assert q.prefill_s([100, 100]) == pytest.approx(0.01 + 1e-4 * 200)
    assert q.decode_step_s(4, 500) == pytest.approx(0.002 + 4e-4)
    with pytest.raises(ValueError, match="decode lacks"):
        Profile.from_dict({"prefill": {"a": 1, "b": 1}, "decode": {"d": 1}})


def test_search_finds_the_known_minimal_pair():
    # Prefill: 0.1 s per prompt, no batching, at 15 req/s: one worker is
    # overloaded, two are not. Decode: 0.01 s per sequence per step, 10 steps
    # per request: a worker serves 10 req/s, so one is overloaded, two are not.
    workload = Workload(
        rate=15, input_len=(64, 64), output_len=(11, 11), arrival="gamma", cv=0.05, num_requests=600
    )
    plan = search(
        workload,
        lambda ls: 0.1 * len(ls),
        lambda b, c: 0.01 * b,
        ttft_slo_s=0.5,
        tpot_slo_s=0.1,
        target=0.9,
        max_workers=6,
        base=SystemConfig(1, 1, prefill_token_budget=0),
    )
    assert plan.best is not None
    assert (plan.best.num_prefill, plan.best.num_decode) == (2, 2)
    assert plan.best.attainment >= 0.9
    tried = {(c.num_prefill, c.num_decode): c.attainment for c in plan.evaluated}
    assert tried[1, 2] < 0.9 and tried[2, 1] < 0.9
    assert (plan.naive.num_prefill, plan.naive.num_decode) == (2, 2)


def test_search_reports_no_plan_when_nothing_fits():
    plan = search(
        Workload(rate=50, num_requests=200),
        lambda ls: 1.0,
        lambda b, c: 0.01,
        ttft_slo_s=0.1,
        tpot_slo_s=1.0,
        max_workers=3,
    )
    assert plan.best is None
    assert (plan.naive.num_prefill, plan.naive.num_decode) == naive_split(3) == (1, 2)


def test_workload_rejects_bad_values():
    with pytest.raises(ValueError):
        Workload(rate=0)
    with pytest.raises(ValueError):
        Workload(rate=1, input_len=(10, 5))
