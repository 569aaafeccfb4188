"""`tandem serve` in a subprocess, for benchmarks that measure the router as it
runs in production (its own process), and stop it cleanly afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVING_LINE = r"tandem: serving .* on (\S+:\d+)"
"""What `tandem serve` prints once it listens; group 1 is the gRPC address."""


@contextlib.contextmanager
def tandem_serve(
    config_yaml: str = "",
    flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    pattern: str = SERVING_LINE,
    start_timeout_s: float = 180.0,
) -> Iterator[tuple[str, ...]]:
    """Start `tandem serve --config <config_yaml> <flags>` and yield the groups of
    ``pattern`` in its first matching output line; SIGTERM it on exit."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config_yaml)
    cmd = [sys.executable, "-m", "tandem_cli.main", "serve", "--config", f.name, *flags]
    full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            match = re.search(pattern, line)
            if match:
                yield match.groups()
                break
            if not line and proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}")
        else:
            raise RuntimeError("tandem serve did not start in time")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(f.name)
