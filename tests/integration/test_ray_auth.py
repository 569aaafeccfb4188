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

# Starts the cluster as `tandem serve` does and tries a driver with no token,
# a wrong one and the right one; prints whether each joined, then whether each
# was refused for its token (Ray's InvalidAuthToken). A refused driver would
# retry for 20 s (Ray's default); RAY_gcs_server_port_wait_time_s gives it 2
# tries: a token it lacks is refused on the first. The right one keeps the
# default.
_CLUSTER = """
import os, subprocess, sys
from tandem_cli import ray_init
from router.config import ServeConfig
ray_init.init_ray(ServeConfig(pools={"prefill": 0, "decode": 1, "mode": "colocated"}))
import ray
address = ray.get_runtime_context().gcs_address
join = "import ray, sys; ray.init(address=sys.argv[1]); print('JOINED')"
results, refusals = [], []
for case in ("none", "wrong", "right"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    if case != "right":
        env["RAY_gcs_server_port_wait_time_s"] = "2"
    if case == "wrong":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64)
    if case == "right":
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ["RAY_AUTH_TOKEN"])
    done = subprocess.run(
        [sys.executable, "-c", join, address], env=env, capture_output=True, text=True, timeout=120
    )
    results.append(f"{case}={'JOINED' in done.stdout}")
    refusals.append(f"{case}={'InvalidAuthToken' in done.stderr}")
print(" ".join(refusals))
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
    *_, refused, joined = done.stdout.strip().splitlines()
    assert joined == "none=False wrong=False right=True"
    assert refused == "none=True wrong=True right=False"  # for their token, not a timeout
    assert not (tmp_path / ".ray" / "auth_token").exists()  # the token was never written
