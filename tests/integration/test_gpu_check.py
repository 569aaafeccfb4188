"""bench/gpu_check.py in its host smoke mode: a tiny model, greedy equal to
Hugging Face, decode step times beside the roofline, a KV push."""

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
    assert result["hf_check"]["equal"] is True
    assert result["hf_check"]["matching_prefix"] == [8, 8, 8, 8]
    assert [row["batch"] for row in result["decode"]] == [1, 4]
    for row in result["decode"]:
        assert row["eager_ms"] > 0 and row["roofline_ms"] > 0
        assert "graphs_ms" not in row  # CUDA graphs only on a GPU
    assert result["decode"][1]["bytes_per_step"] > result["decode"][0]["bytes_per_step"]
    assert result["transfer"]["bytes"] > 0 and result["transfer"]["push_gb_s"] > 0
