"""`tandem plan` end to end: from a saved synthetic profile, with a short real
profiling run of the default model, and the --verify-target replay against a
router over a fake backend (the model against a measured replay:
test_plan_verify.py)."""

from __future__ import annotations

import json
import re

import pytest

from tandem_cli.main import main
from tests.fakes import FakeBackend, FakeTokenizer, RouterInThread

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PLAN_LINE = re.compile(r"^plan: prefill=(\d+) decode=(\d+)\s+attainment ([\d.]+)%", re.M)
NAIVE_LINE = re.compile(r"^naive: prefill=(\d+) decode=(\d+)\s+attainment ([\d.]+)%", re.M)


@pytest.fixture
def synthetic_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "prefill": {"a": 0.005, "b": 2e-4, "c": 0.0},  # 256 tokens: ~56 ms
                "decode": {"d": 0.004, "e": 5e-4, "f": 1e-8},
                "kv_bytes_per_token": 8192,
                "vocab_size": 200,
            }
        )
    )
    return path


def test_plan_from_a_saved_profile(synthetic_profile, capsys):
    code = main(
        [
            "plan",
            "--profile", str(synthetic_profile),
            "--rate", "2",
            "--input-len", "64:512",
            "--output-len", "64",
            "--slo", "ttft_ms=1000,tpot_ms=100",
            "--max-workers", "4",
            "--num-requests", "200",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "prefill_s(L)" in out and "decode_step_s(B, ctx)" in out
    plan = PLAN_LINE.search(out)
    assert plan, out
    assert (int(plan[1]), int(plan[2])) == (1, 1)  # light load: the smallest pair
    assert float(plan[3]) >= 90.0
    assert NAIVE_LINE.search(out), out


def test_plan_exits_1_when_nothing_meets_the_slo(synthetic_profile, capsys):
    code = main(
        [
            "plan", "--profile", str(synthetic_profile), "--rate", "2",
            "--slo", "ttft_ms=1", "--max-workers", "3", "--num-requests", "50",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "plan: none up to 3 workers" in out
    assert NAIVE_LINE.search(out)


def test_plan_rejects_a_bad_slo_and_a_missing_profile(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--slo", "latency=3"])
    assert e.value.code == 2
    assert main(["plan", "--profile", str(tmp_path / "nope.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err


def test_quick_real_profile_writes_json(tmp_path, capsys):
    out_path = tmp_path / "measured.json"
    code = main(
        [
            "plan", "--quick", "--profile-out", str(out_path),
            "--rate", "2", "--input-len", "64:512", "--output-len", "64",
            "--slo", "ttft_ms=1000,tpot_ms=100", "--max-workers", "4", "--num-requests", "200",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code in (0, 1), out  # 1 only if the measured model is too slow for the SLO
    data = json.loads(out_path.read_text())
    assert set(data["prefill"]) >= {"a", "b", "c"} and set(data["decode"]) >= {"d", "e", "f"}
    assert len(data["prefill_samples"]) >= 3 and len(data["decode_samples"]) >= 3
    assert data["kv_bytes_per_token"] > 0
    assert all(s["seconds"] > 0 for s in data["prefill_samples"] + data["decode_samples"])
    assert PLAN_LINE.search(out) or "plan: none" in out


def test_verify_target_replays_load_against_a_router(synthetic_profile, capsys):
    backend = FakeBackend(tokenizer=FakeTokenizer(), max_model_len=64, delay_s=0.002)
    with RouterInThread(backend) as router:
        code = main(
            [
                "plan", "--profile", str(synthetic_profile),
                "--rate", "20", "--input-len", "4:8", "--output-len", "4",
                "--slo", "ttft_ms=5000,tpot_ms=5000", "--max-workers", "2",
                "--num-requests", "50",
                "--verify-target", router.address, "--verify-requests", "6",
            ]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    m = re.search(
        r"verify: measured attainment ([\d.]+)% \(predicted ([\d.]+)%\), (\d+) errors", out
    )
    assert m, out
    assert float(m[1]) == 100.0 and int(m[3]) == 0
    assert len(backend.finished) == 6
    assert all(len(i.prompt_token_ids) <= 8 for i in backend.inputs)
    assert re.search(r"ttft_p50 ms\s+[\d.]+\s+[\d.]+\s+[+-][\d.]+%", out), out
