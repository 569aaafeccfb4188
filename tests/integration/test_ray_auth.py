"""The local Ray cluster ``tandem serve`` starts (tandem_cli/ray_init.py,
init_ray) refuses a driver without its token: a process that reaches the GCS
port with no token, or a wrong one, cannot join and run code there.

The cluster is started in a process of its own, so this test's session
(and its Ray) is not touched."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

# Starts the cluster as `tandem serve` does, prints the GCS address and reads
# the token a driver should try from stdin, one per line; prints whether it
# joined.
_CLUSTER = """
import os, subprocess, sys
from tandem_cli import ray_init
from router.config import ServeConfig
ray_init.init_ray(ServeConfig(pools={"prefill": 0, "decode": 1, "mode": "colocated"}))
import ray
address = ray.get_runtime_context().gcs_address
join = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED')"
results = []
for case in ("none", "wrong", "right"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    if case == "wrong":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    if case == "right":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ["RAY_AUTH_TOKEN"])
    done = subprocess.run(
        [sys.executable, "-c", join, address], env=env, capture_output=True, text=True, timeout=120
    )
    results.append(f"{case}={'JOINED' in done.stdout}")
print(" ".join(results))
ray.shutdown()
"""


def test_the_local_cluster_refuses_a_driver_without_its_token(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"
    }
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token of the machine's user to fall back on
    done = subprocess.run(
        [sys.executable, "-c", _CLUSTER], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "none=False wrong=False right=True"
    assert not (tmp_path / ".ray" / "auth_token").exists()  # the token was never written
