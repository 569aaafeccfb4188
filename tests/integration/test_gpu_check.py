"""bench/gpu_check.py in its host smoke mode: a tiny model, greedy equal to
Hugging Face, decode step times beside the roofline, prefill rates, a KV push."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(660)  # its subprocess may take 600 s
def test_gpu_check_smoke_mode_on_the_host():
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tiny", "--dtype", "float32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu"
    exact, low = result["hf_check"]
    assert exact["dtype"] == "float32" and exact["equal"] is True
    assert exact["matching_prefix"] == [8, 8, 8, 8]
    assert low["dtype"] == "bfloat16" and len(low["matching_prefix"]) == 4
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    for row in result["decode"]:
        assert row["host_eager_ms"] > 0 and row["roofline_ms"] > 0
        assert not any("graphs" in key or "kernel" in key for key in row)  # GPU only
    assert result["prefill"]["host_tokens_per_s"] > 0 and result["prefill"]["hf_tokens_per_s"] > 0
    assert result["decode"][1]["bytes_per_step"] > result["decode"][0]["bytes_per_step"]
    overlap = result["copy_overlap"]
    assert overlap["step_alone_ms"] > 0 and overlap["step_with_copies_ms"] > 0
    assert overlap["copy_gb_s_alone"] > 0 and overlap["copy_gb_s_during_decode"] > 0
    tp = result["tensor_parallel"]  # gloo on the host
    assert tp["equal"] is True and tp["tp1_tokens_per_s"] > 0 and tp["tp2_tokens_per_s"] > 0
    assert result["transfer"]["bytes"] > 0 and result["transfer"]["push_gb_s"] > 0
