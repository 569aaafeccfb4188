"""A named deployment's local Ray cluster outlives the process that started
it, and `tandem down` stops exactly that cluster.

Three processes play three shells: the first connects as `tandem serve
--deployment NAME` does (tandem_cli/ray_init.py), starts a detached named
actor (a stand-in for a pool worker) and exits; the second attaches as
`tandem serve --deployment NAME --attach` does and finds that actor alive;
the third runs `tandem down --deployment NAME` (its router.deployment.down a
stand-in that removes the actor). The state file lives under a temporary
XDG_STATE_HOME; the cluster is started and stopped by its session, so no
other Ray cluster on the machine is touched."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_cli import cluster_state, local_cluster

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

_FIRST = """
import sys, ray
from tandem_cli import ray_init
from router.config import ServeConfig
name = sys.argv[1]
pools = {"prefill": 0, "decode": 1, "mode": "colocated"}
config = ServeConfig(deployment={"name": name}, pools=pools)
assert ray_init.init_ray(config)

@ray.remote(num_cpus=0)
class Worker:
    def ping(self):
        return "pong"

worker = Worker.options(name="decode-0", namespace="tandem-" + name, lifetime="detached").remote()
print(ray.get(worker.ping.remote()), flush=True)
ray.shutdown()
"""

_ATTACH = """
import sys, ray
from tandem_cli import ray_init
from router.config import ServeConfig
name = sys.argv[1]
assert ray_init.init_ray(ServeConfig(deployment={"name": name, "attach": True}))
worker = ray.get_actor("decode-0", namespace="tandem-" + name)
print(ray.get(worker.ping.remote()), flush=True)
ray.shutdown()
"""

_DOWN = """
import sys, types, ray

def down(name, drain_timeout_s):
    ray.kill(ray.get_actor("decode-0", namespace="tandem-" + name), no_restart=True)
    return ["decode-0"]

sys.modules["router.deployment"] = types.SimpleNamespace(down=down)
from tandem_cli.main import main
sys.exit(main(["down", "--deployment", sys.argv[1], "--drain-timeout", "1"]))
"""


def _run(script: str, name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, name],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_cluster_outlives_its_router_and_down_stops_it(tmp_path, monkeypatch):
    name = f"it-{secrets.token_hex(4)}"
    state_home = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state_home))
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"
    }
    env.update(XDG_STATE_HOME=str(state_home), HOME=str(tmp_path), PYTHONPATH=str(REPO))
    try:
        first = _run(_FIRST, name, env)
        assert first.returncode == 0, first.stderr[-3000:]
        assert first.stdout.splitlines()[-1] == "pong"

        state = cluster_state.read(name)
        assert state is not None and state.token  # generated, and recorded for the next router
        assert state.node_ip == "127.0.0.2" and not state.address.endswith(":6379")
        assert local_cluster.is_running(state)  # its starter has exited
        daemons = [
            Path(f"/proc/{p}/cmdline").read_bytes() for p in local_cluster.session_pids(state.pid)
        ]
        assert any(b"raylet" in c for c in daemons) and any(b"gcs_server" in c for c in daemons)
        assert not (
            tmp_path / ".ray" / "auth_token"
        ).exists()  # the token is in the state file only

        attached = _run(_ATTACH, name, env)
        assert attached.returncode == 0, attached.stderr[-3000:]
        assert attached.stdout.splitlines()[-1] == "pong"  # the worker outlived the first router

        downed = _run(_DOWN, name, env)
        assert downed.returncode == 0, downed.stderr[-3000:]
        assert "stopped its local Ray cluster" in downed.stdout
        assert local_cluster.session_pids(state.pid) == []  # GCS, raylet, workers: all gone
        assert not local_cluster.is_running(state)
        assert cluster_state.read(name) is None and not Path(state.temp_dir).exists()
    finally:
        local_cluster.stop(name)  # after a failure above: never leave the cluster behind
