"""Rate schedules (benchkit/schedule.py): steps, daily shape, bursts, arrivals."""

from __future__ import annotations

import math

import pytest

from benchkit.runner import LoadSpec
from benchkit.schedule import (
    DAILY_PIECES,
    Burst,
    RateSchedule,
    Segment,
    parse_bursts,
    parse_schedule,
)
from benchkit.workload import arrival_offsets

pytestmark = pytest.mark.unit


def test_steps_parse_with_the_last_step_as_long_as_the_one_before():
    s = parse_schedule("0:2,60:8,120:2")
    assert s.segments == (Segment(0, 2), Segment(60, 8), Segment(120, 2))
    assert s.duration_s == 180
    assert s.rate_at(59.9) == 2 and s.rate_at(60) == 8 and s.rate_at(179) == 2
    assert s.rate_at(180) == 0 and s.rate_at(-1) == 0
    assert s.expected(0, 180) == 2 * 60 + 8 * 60 + 2 * 60
    assert s.expected(50, 70) == 2 * 10 + 8 * 10
    assert parse_schedule("0:3").duration_s == 60
    assert parse_schedule("0:2,10:4", duration_s=15).expected(0, 15) == 2 * 10 + 4 * 5


@pytest.mark.parametrize(
    "text",
    ["", "5:2", "0:2,0:3", "0:-1", "0:x", "0", "daily:1", "0:2,60:8,50:1", "0:inf"],
)
def test_bad_schedules_are_refused(text):
    with pytest.raises(ValueError):
        parse_schedule(text, duration_s=100)


def test_a_daily_shape_needs_a_duration_and_peaks_at_16h():
    with pytest.raises(ValueError, match="--duration"):
        parse_schedule("daily:1:9")
    s = parse_schedule("daily:1:9", duration_s=240)
    assert len(s.segments) == DAILY_PIECES
    assert s.peak() == pytest.approx(9, abs=0.01)
    # 240 s is a day: the trough (04:00) is at 40 s, the peak (16:00) at 160 s.
    assert s.rate_at(40) == pytest.approx(1, abs=0.01)
    assert s.rate_at(160) == pytest.approx(9, abs=0.01)
    assert s.rate_at(100) == pytest.approx(5, abs=0.2)  # 10:00, halfway
    # A raised cosine over the day averages (LOW + PEAK) / 2.
    assert s.expected(0, 240) == pytest.approx(5 * 240, rel=1e-3)


def test_bursts_multiply_the_rate_over_their_span():
    s = parse_schedule("0:2,60:8,120:2").with_bursts(parse_bursts("30:5:4,110:20:2"))
    assert s.rate_at(29) == 2 and s.rate_at(30) == 8 and s.rate_at(34.9) == 8 and s.rate_at(35) == 2
    assert s.rate_at(115) == 16 and s.rate_at(120) == 4 and s.rate_at(130) == 2
    assert s.expected(0, 180) == 720 + 5 * (8 - 2) + 10 * (16 - 8) + 10 * (4 - 2)
    assert parse_bursts("1:2:3") == [Burst(1, 2, 3)]
    for bad in ("1:2", "1:0:3", "a:1:2"):
        with pytest.raises(ValueError):
            parse_bursts(bad)


def test_arrivals_follow_the_schedule():
    s = parse_schedule("0:2,100:20,200:2")
    times = s.arrivals(seed=3)
    assert times[0] == 0 and times == sorted(times) and times[-1] < 300
    counts = [sum(lo <= t < lo + 100 for t in times) for lo in (0, 100, 200)]
    # Poisson counts of mean 200, 2000, 200: well within 5 standard deviations.
    for got, mean in zip(counts, (200, 2000, 200), strict=True):
        assert abs(got - mean) < 5 * math.sqrt(mean), counts
    assert s.arrivals(seed=3) == times  # seeded
    assert s.arrivals(seed=4) != times


def test_a_constant_schedule_gives_the_constant_rates_arrivals():
    s = RateSchedule((Segment(0, 4.0),), 30.0)
    got = s.arrivals(seed=7, burstiness=0.5)
    want = [t for t in arrival_offsets(400, 4.0, 0.5, seed=7) if t < 30.0]
    assert len(got) == len(want)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_a_load_spec_takes_a_schedule_and_its_length():
    s = parse_schedule("0:1,5:3", duration_s=10)
    load = LoadSpec(schedule=s)
    assert load.duration_s == 10
    assert list(load.arrival_offsets()) == s.arrivals(0)
    with pytest.raises(ValueError):
        LoadSpec(schedule=s, rate=2.0)
    rate = LoadSpec(rate=2.0, num_requests=3)
    offsets = rate.arrival_offsets()
    assert [next(offsets) for _ in range(3)] == arrival_offsets(3, 2.0)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--rate-schedule", "5:2"], "--rate-schedule: a schedule starts at 0 s"),
        (["--rate-schedule", "daily:1:4"], "--duration"),
        (["--bursts", "1:2:3"], "--bursts is for --rate-schedule"),
        (["--rate-schedule", "0:1", "--window", "0"], "must be positive"),
    ],
)
def test_the_cli_refuses_a_bad_schedule_before_connecting(argv, why, capsys):
    from tandem_cli.main import main

    assert main(["bench", "--target", "127.0.0.1:1", *argv]) == 2
    assert why in capsys.readouterr().err
