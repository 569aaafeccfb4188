"""SLO attainment per window (benchkit/windows.py), pool sizes from /metrics
(benchkit/pools.py) and the schedule plot, on a synthetic trace."""

from __future__ import annotations

import pytest

from benchkit.metrics import RequestRecord
from benchkit.plots import plot_schedule
from benchkit.pools import PoolSample, parse_pool_sizes
from benchkit.schedule import parse_schedule
from benchkit.windows import window_stats, worst_attainment

pytestmark = pytest.mark.unit

START = 1000.0  # the run's clock at its start


def _rec(sent: float, ttft_s: float, status: str = "OK") -> RequestRecord:
    """A request sent ``sent`` s into the run, first token after ``ttft_s``, then
    3 more tokens 10 ms apart."""
    t0 = START + sent
    chunks = [(t0 + ttft_s + 0.01 * i, 1) for i in range(4)]
    return RequestRecord(
        send_time=t0, chunks=chunks if status == "OK" else [], end_time=chunks[-1][0],
        status=status,
    )  # fmt: skip


def _trace() -> list[RequestRecord]:
    # window 0-10: 4 sent, 3 within TTFT 100 ms; window 10-20: 2 sent, one failed,
    # one slow; window 20-30: none; window 30-35: 1 within.
    return [
        _rec(0.0, 0.05), _rec(2.0, 0.08), _rec(5.0, 0.099), _rec(9.99, 0.3),
        _rec(10.0, 0.05, status="UNAVAILABLE"), _rec(15.0, 0.2),
        _rec(31.0, 0.01),
    ]  # fmt: skip


def test_attainment_per_window_is_exact_on_a_synthetic_trace():
    schedule = parse_schedule("0:0.4,10:0.2,20:0,30:0.2", duration_s=35)
    windows = window_stats(_trace(), START, 10.0, 35.0, {"ttft_ms": 100}, schedule)
    assert [(w.start_s, w.end_s) for w in windows] == [(0, 10), (10, 20), (20, 30), (30, 35)]
    assert [w.sent for w in windows] == [4, 2, 0, 1]
    assert [w.failed for w in windows] == [0, 1, 0, 0]
    assert [w.good for w in windows] == [3, 0, 0, 1]
    assert [w.attainment for w in windows] == [0.75, 0.0, None, 1.0]
    assert [w.offered_rate for w in windows] == pytest.approx([0.4, 0.2, 0.0, 0.2])
    assert windows[0].ttft_p50_s == pytest.approx((0.08 + 0.099) / 2)
    assert windows[0].tpot_p50_s == pytest.approx(0.01)
    assert windows[1].ttft_p90_s == pytest.approx(0.2)  # the failed request has none
    assert windows[2].ttft_p50_s is None
    assert worst_attainment(windows) == 0.0


def test_a_tpot_limit_and_no_limit():
    windows = window_stats(_trace(), START, 20.0, 35.0, {"tpot_ms": 5})
    assert [w.attainment for w in windows] == [0.0, 0.0]  # every TPOT is 10 ms
    windows = window_stats(_trace(), START, 20.0, 35.0, {})
    assert [w.good for w in windows] == [5, 1]  # all but the failed one
    assert windows[0].offered_rate is None


METRICS = """\
# HELP tandem_pool_workers Workers in routing
# TYPE tandem_pool_workers gauge
tandem_pool_workers{pool="prefill"} 2.0
tandem_pool_workers{pool="decode"} 3.0
# HELP tandem_pool_target_workers What the autoscaler aims at
# TYPE tandem_pool_target_workers gauge
tandem_pool_target_workers{pool="prefill"} 4.0
"""
PER_WORKER = """\
# TYPE tandem_worker_kv_blocks_total gauge
tandem_worker_kv_blocks_total{role="prefill",worker="prefill-0"} 64.0
tandem_worker_kv_blocks_total{role="decode",worker="decode-0"} 64.0
tandem_worker_kv_blocks_total{role="decode",worker="decode-1"} 64.0
"""


def test_pool_sizes_from_metrics():
    assert parse_pool_sizes(METRICS) == {"decode": (3, None), "prefill": (2, 4)}
    assert parse_pool_sizes(PER_WORKER) == {"decode": (2, None), "prefill": (1, None)}
    assert parse_pool_sizes("") == {}


def test_the_schedule_plot_is_written(tmp_path):
    windows = window_stats(_trace(), START, 10.0, 35.0, {"ttft_ms": 100})
    pools = [
        PoolSample(0, "decode", 1, 1),
        PoolSample(5, "decode", 2, 3),
        PoolSample(5, "prefill", 1, None),
    ]
    path = plot_schedule(windows, pools, tmp_path)
    assert path == tmp_path / "schedule.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_schedule(windows, [], tmp_path, "empty.png").stat().st_size > 0
