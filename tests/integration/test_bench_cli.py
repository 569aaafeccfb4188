"""`tandem bench` against a live deployment (1 prefill + 1 decode, Ray on loopback):
exit code, the JSON report's counts and goodput, the PNG plots. No timing is
asserted (2 shared cores); generous SLOs make every finished request good."""

from __future__ import annotations

import functools
import json

import pytest

from benchkit import runner
from benchkit.deployment import Deployment
from router.config import ServeConfig
from tandem_cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def deployment(ray_cluster):
    dep = Deployment(ServeConfig(engine={"kv_cache_memory_mb": 32}))
    yield dep
    dep.stop()


def test_bench_open_loop(deployment, tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--target",
            deployment.address,
            "--num-requests",
            "12",
            "--rate",
            "8",
            "--input-len",
            "32:64",
            "--output-len",
            "8",
            "--out",
            str(tmp_path),
            "--slo",
            "ttft_ms=100000,tpot_ms=100000",
        ]
    )
    out = capsys.readouterr().out
    print(out)  # the human table, shown with -s or on failure
    assert rc == 0
    report_path = tmp_path / "report.json"
    assert str(report_path) in out and "TTFT" in out and "goodput" in out

    report = json.loads(report_path.read_text())
    (run,) = report["runs"]
    s = run["summary"]
    assert s["requests"] == 12 and s["completed"] == 12
    assert s["failed"] == 0 and s["errors"] == {}
    assert s["goodput"]["good"] == 12 and s["goodput"]["share"] == 1.0
    assert s["goodput"]["rate"] > 0
    assert s["output_tokens"] == 12 * 8  # ignore_eos: every answer is max_tokens long
    for key in ("ttft_s", "tpot_s", "e2e_s", "server_ttft_s"):
        assert s[key]["count"] == 12
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    # One gap per token after a request's first chunk. A router that finds a
    # request's next tokens already queued sends them in one chunk, the first
    # chunk included, so how many gaps there are depends on timing: at most
    # seven a request, and more than none once answers stream at all.
    assert 0 < s["itl_s"]["count"] <= 12 * 7
    rows = run["requests"]
    assert len(rows) == 12
    assert all(32 <= r["input_len"] <= 64 and r["output_tokens"] == 8 for r in rows)
    assert all(r["prefill_worker"] and r["decode_worker"] for r in rows)

    for name in ("ttft_cdf.png", "tpot_cdf.png", "itl_cdf.png", "e2e_cdf.png"):
        png = tmp_path / name
        assert png.is_file() and png.stat().st_size > 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert deployment.leaked_blocks() == {}


def test_bench_sweep_closed_loop_and_turns(deployment, tmp_path, capsys):
    """A two-rate sweep with shared prefixes and 2-turn conversations, then a
    closed-loop run: counts, cached tokens and the sweep plot."""
    common = ["bench", "--target", deployment.address, "--no-progress"]
    rc = main(
        [
            *common,
            "--rate-sweep",
            "4,16",
            "--num-requests",
            "6",
            "--input-len",
            "48",
            "--output-len",
            "4",
            "--shared-prefix-ratio",
            "0.75",
            "--turns",
            "2",
            "--out",
            str(tmp_path / "sweep"),
            "--slo",
            "ttft_ms=100000",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((tmp_path / "sweep" / "report.json").read_text())
    assert [r["load"]["rate"] for r in report["runs"]] == [4.0, 16.0]
    for run in report["runs"]:
        s = run["summary"]
        assert s["requests"] == 6 and s["failed"] == 0
        turns = sorted(r["turn"] for r in run["requests"])
        assert turns == [0, 0, 0, 1, 1, 1]
        # A second turn's prompt holds the first prompt, its answer and a new message.
        assert all(r["input_len"] == 48 + 4 + 48 for r in run["requests"] if r["turn"] == 1)
        assert s["cached_tokens"] > 0  # shared prefixes and conversation history
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0

    rc = main(
        [
            *common,
            "--concurrency",
            "3",
            "--num-requests",
            "5",
            "--input-len",
            "16:32",
            "--output-len",
            "2:6",
            "--out",
            str(tmp_path / "closed"),
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "closed" / "report.json").read_text())
    (run,) = report["runs"]
    assert run["label"] == "concurrency=3"
    assert run["summary"]["requests"] == 5 and run["summary"]["failed"] == 0
    assert "goodput" not in run["summary"]
    assert deployment.leaked_blocks() == {}


def test_bench_unreachable_target(tmp_path, capsys, monkeypatch):
    # Nothing listens there: the bench would wait its 10 s for an answer; 1 s will do.
    monkeypatch.setattr(runner, "wait_ready", functools.partial(runner.wait_ready, timeout_s=1.0))
    rc = main(["bench", "--target", "127.0.0.1:1", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert "cannot reach" in capsys.readouterr().err
