"""The planner's model on cases whose answer follows by hand: the KV push in
TTFT, the decode step boundary, a full KV pool, prefix hits, batch-dependent
TPOT; traces and the run-time API."""

from __future__ import annotations

import pytest

from planner.predict import SLO, cheapest_split, predict, predict_trace
from planner.simulator import SystemConfig, simulate
from planner.trace import Trace, TraceRequest, WorkloadStats, chat, multi_turn

pytestmark = pytest.mark.unit

BS = 16


def trace(*reqs: tuple[float, int, int], base: int = 1) -> Trace:
    """(arrival, prompt length, output length) with prompts of their own."""
    return Trace(
        "t",
        tuple(TraceRequest(t, (base + i,) * n, out) for i, (t, n, out) in enumerate(reqs)),
    )


def run(tr: Trace, system: SystemConfig, prefill=lambda ls: 0.05, decode=lambda b, c: 0.01):
    return simulate(tr, system, prefill, decode)


def test_ttft_counts_the_kv_push_the_call_and_the_stream():
    # 100 tokens = 7 blocks of 16 = 112 tokens moved, 1000 B each at 1 MB/s.
    system = SystemConfig(
        1, 1, kv_bytes_per_token=1000, kv_bandwidth_Bps=1e6, kv_latency_s=0.002,
        rpc_latency_s=0.001, stream_latency_s=0.003,
    )  # fmt: skip
    res = run(trace((1.0, 100, 5)), system)
    push = 0.002 + 7 * BS * 1000 / 1e6
    assert res.ttft[0] == pytest.approx(0.001 + 0.05 + push + 0.003)
    assert res.tpot[0] == pytest.approx(0.01)  # the stream latency cancels
    assert res.requests[0].pushed_blocks == 7


def test_first_token_waits_for_the_decode_step_under_way():
    # A's decode steps take 0.1 s from t = 0.05 (its prefill); B's push
    # commits at 1.0 + 0.05, mid-step (steps end at 0.05 + 0.1k): B's
    # first token goes out at 1.05 only if a step ends there. Step ends:
    # A's first token at 0.05, its steps end at 0.15, 0.25, ..., 1.05, 1.15.
    # B arrives at 1.01: committed at 1.06, first token at 1.15.
    system = SystemConfig(1, 1, kv_latency_s=0.0)
    res = run(trace((0.0, 20, 100), (1.01, 20, 3)), system, decode=lambda b, c: 0.1)
    assert res.ttft[1] == pytest.approx(1.15 - 1.01)
    # B then joins the next step: tokens at 1.25 and 1.35.
    assert res.tpot[1] == pytest.approx(0.1)


def test_a_full_decode_pool_makes_the_next_request_wait_for_room():
    # Each request needs ceil((100 + 60) / 16) = 10 blocks; the pool holds 10.
    system = SystemConfig(1, 2 - 1, decode_kv_blocks=10, kv_latency_s=0.0)
    res = run(trace((0.0, 100, 60), (0.001, 100, 60)), system)
    a, b = res.requests
    assert a.admitted == 0.0
    assert b.admitted == pytest.approx(a.finish)  # room comes back when A ends
    assert a.finish == pytest.approx(0.05 + 59 * 0.01)
    assert res.ttft[1] == pytest.approx(a.finish - 0.001 + 0.05)
    # A second decode worker has room at once.
    two = run(trace((0.0, 100, 60), (0.001, 100, 60)), replace_pools(system, 1, 2))
    assert two.requests[1].admitted == pytest.approx(0.001)


def replace_pools(system: SystemConfig, p: int, d: int) -> SystemConfig:
    from dataclasses import replace

    return replace(system, num_prefill=p, num_decode=d)


def test_a_request_longer_than_the_pool_fails_and_the_rest_run():
    system = SystemConfig(1, 1, decode_kv_blocks=10, kv_latency_s=0.0)
    res = run(trace((0.0, 400, 10), (0.1, 50, 10)), system)
    assert res.failed == 1 and res.requests[0].failed
    assert len(res.ttft) == 1 and res.attainment == 0.5


def test_a_cached_prefix_is_not_prefilled_again():
    seen: list[list[int]] = []

    def prefill(ls):
        seen.append(list(ls))
        return 0.05

    prompt = tuple(range(1, 1001))  # 1000 tokens: 62 full blocks
    tr = Trace("t", (TraceRequest(0.0, prompt, 2), TraceRequest(5.0, prompt + (7,) * 500, 2)))
    # local prefill off: the prefill worker prefills the 500-token tail.
    res = simulate(tr, SystemConfig(1, 1, local_prefill_tokens=0), prefill, lambda b, c: 0.01)
    assert seen[0] == [512] and seen[1] == [488]  # 1000 in two steps of the budget
    assert seen[2:] == [[508]]  # 62 blocks = 992 cached; 508 left: one step
    assert res.requests[1].cached_tokens == 992
    # The decode worker holds the prompt too: only the blocks past it move.
    assert res.requests[1].pushed_blocks == -(-1500 // BS) - 62


def test_a_short_tail_after_a_prefix_on_the_decode_worker_is_prefilled_there():
    prompt = tuple(range(1, 321))  # 20 blocks
    tr = Trace("t", (TraceRequest(0.0, prompt, 2), TraceRequest(5.0, prompt + (9,) * 100, 2)))
    res = simulate(tr, SystemConfig(1, 1, kv_latency_s=0.0), lambda ls: 0.05, lambda b, c: 0.01)
    second = res.requests[1]
    assert second.local and second.pushed_blocks == 0 and second.cached_tokens == 320
    assert res.ttft[1] == pytest.approx(0.05)  # one prefill step on the decode worker


def test_prefix_cache_capacity_limits_hits():
    prompt = tuple(range(1, 321))  # 20 blocks
    other = tuple(range(1000, 1320))
    reqs = (TraceRequest(0.0, prompt, 2), TraceRequest(1.0, other, 2), TraceRequest(2.0, prompt, 2))
    kw = dict(local_prefill_tokens=0, decode_kv_blocks=30)
    big = simulate(Trace("t", reqs), SystemConfig(1, 1, prefill_kv_blocks=100, **kw),
                   lambda ls: 0.05, lambda b, c: 0.01)  # fmt: skip
    small = simulate(Trace("t", reqs), SystemConfig(1, 1, prefill_kv_blocks=25, **kw),
                     lambda ls: 0.05, lambda b, c: 0.01)  # fmt: skip
    assert big.requests[2].cached_tokens == 19 * BS  # one token is always computed
    assert small.requests[2].cached_tokens == 0  # evicted by the other prompt


def test_tpot_follows_the_decode_batch():
    # Four prompts prefilled in one step, pushed together, decoded together.
    tr = trace(*((0.0, 50, 11) for _ in range(4)))
    res = run(tr, SystemConfig(1, 1, kv_latency_s=0.0), decode=lambda b, c: 0.01 * b)
    assert res.tpot == pytest.approx([0.04] * 4)
    one = run(trace((0.0, 50, 11)), SystemConfig(1, 1, kv_latency_s=0.0),
              decode=lambda b, c: 0.01 * b)  # fmt: skip
    assert one.tpot == pytest.approx([0.01])


def test_requests_decoding_at_the_start_slow_the_steps_and_stay_out_of_the_result():
    # Three requests decode on the one worker when the trace starts, 20 tokens
    # left each: the new request's 10 steps run at a batch of 4.
    resident = [TraceRequest(0.0, (100 + i,) * 50, 20) for i in range(3)]
    res = simulate(trace((0.0, 50, 11)), SystemConfig(1, 1, kv_latency_s=0.0),
                   lambda ls: 0.05, lambda b, c: 0.01 * b, resident=resident)  # fmt: skip
    assert res.tpot == pytest.approx([0.04]) and len(res.ttft) == 1
    alone = run(trace((0.0, 50, 11)), SystemConfig(1, 1, kv_latency_s=0.0),
                decode=lambda b, c: 0.01 * b)  # fmt: skip
    assert alone.tpot == pytest.approx([0.01])


def test_tpot_follows_the_context():
    cost = lambda b, c: 1e-5 * c  # noqa: E731
    short = run(trace((0.0, 100, 3)), SystemConfig(1, 1), decode=cost)
    long = run(trace((0.0, 1000, 3)), SystemConfig(1, 1), decode=cost)
    # Steps at contexts 101 and 102 vs 1001 and 1002.
    assert short.tpot[0] == pytest.approx(1e-5 * 101.5)
    assert long.tpot[0] == pytest.approx(1e-5 * 1001.5)


def test_traces_round_trip_and_share_what_they_should(tmp_path):
    t = multi_turn(rate=4, num_requests=60, vocab=500, seed=1)
    path = tmp_path / "t.json"
    t.save(path)
    assert Trace.load(path) == t
    assert t.stats().prefix_share > 0.5  # later turns repeat the conversation
    assert chat(rate=4, num_requests=60, vocab=500, seed=1).stats().prefix_share < 0.01
    assert multi_turn(rate=4, num_requests=60, vocab=500, seed=1) == t  # seeded
    with pytest.raises(ValueError):
        Trace("bad", (TraceRequest(1.0, (1,), 1), TraceRequest(0.5, (1,), 1)))


def test_predict_and_the_cheapest_split_on_a_known_case():
    class Cost:
        def prefill_s(self, lengths):
            return 0.1 * len(lengths)  # every step one prompt (budget 0 below)

        def decode_step_s(self, batch, ctx):
            return 0.01 * batch

    stats = WorkloadStats(
        rate=15, prompt_lens=(100, 100), output_lens=(10, 10),
        mean_prompt_len=100, mean_output_len=10, prefix_share=0.0,
    )  # fmt: skip
    system = SystemConfig(1, 1, prefill_token_budget=0, kv_latency_s=0.0)
    light = predict(Cost(), WorkloadStats(**{**stats.__dict__, "rate": 0.5}), 1, 1, system)
    assert light.ttft_p50 == pytest.approx(0.1, rel=0.05)
    assert light.tpot_p50 == pytest.approx(0.01, rel=0.1)
    # 15 req/s of 0.1 s prefills: one prefill worker is overloaded, two are not.
    split = cheapest_split(Cost(), stats, SLO(ttft_s=0.5, tpot_s=0.1), max_workers=6, system=system)
    assert split is not None and split.prefill_workers == 2
    assert split.prediction.ttft_p90 <= 0.5
    over = predict(Cost(), stats, 1, 3, system, SLO(0.5, 0.1))
    assert over.attainment < 0.5 and over.ttft_p90 > 1.0


def test_predict_trace_matches_simulate():
    class Cost:
        def prefill_s(self, lengths):
            return 0.001 * sum(lengths) / 10

        def decode_step_s(self, batch, ctx):
            return 0.005 + 0.001 * batch

    t = chat(rate=8, num_requests=80, vocab=500, seed=2)
    p = predict_trace(Cost(), t, 2, 2)
    res = simulate(t, SystemConfig(2, 2), Cost().prefill_s, Cost().decode_step_s)
    assert p.ttft_p90 == pytest.approx(res.summary()["ttft_p90_ms"] / 1e3)


def test_calibration_recovers_the_path_costs_of_a_probe():
    from planner.calibrate import Calibration, fit, probe_trace
    from planner.verify import Measured

    class Cost:
        def prefill_s(self, lengths):
            return 0.01 + 1e-4 * sum(lengths)

        def decode_step_s(self, batch, ctx):
            return 0.02 + 1e-3 * batch

    probe = probe_trace(vocab=500, lengths=(64, 1024))
    truth = Calibration(fixed_s=0.025, step_s=0.0015, local_s=0.008)
    base = SystemConfig(1, 1)
    real = simulate(probe, truth.apply(base), Cost().prefill_s, Cost().decode_step_s)
    assert [r.local for r in real.requests] == [False, True, False, True]
    measured = Measured(list(real.ttft), list(real.tpot), 0, list(range(len(probe.requests))))
    got = fit(base, Cost(), probe, measured)
    assert got.fixed_s == pytest.approx(0.025)
    assert got.step_s == pytest.approx(0.0015)
    assert got.local_s == pytest.approx(0.008)


def test_the_run_time_model_imports_no_torch_nor_the_engine():
    # The router's autoscaler calls it; only planner/profile.py's profiler
    # may load the engine (inside the function that profiles).
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "planner"
    model = ["blocks", "calibrate", "cluster", "predict", "search", "settings", "simulator",
             "trace", "verify", "workers"]  # fmt: skip
    for name in model:
        tree = ast.parse((folder / f"{name}.py").read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                assert m.split(".")[0] not in {"torch", "engine", "transformers", "ray"}, (name, m)
