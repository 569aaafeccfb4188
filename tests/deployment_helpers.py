"""Helpers for the integration tests' deployments: one in this process that
ends with the leak check (``deployed``), and for the tests of named
deployments, which worker actors (and processes) a router uses, and a router
of a deployment in a process of its own
(tests/integration/deployment_router_driver.py) for a test to SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ray
from ray._private import state as ray_state

from benchkit.deployment import Deployment
from router.config import ServeConfig
from router.ray_backend import RayBackend

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "integration" / "deployment_router_driver.py"


@contextlib.contextmanager
def deployed(
    config: ServeConfig,
    actor_classes: Mapping[str, type] | None = None,
    backend_cls: type[RayBackend] = RayBackend,
) -> Iterator[Deployment]:
    """A Deployment of ``config`` (its arguments as ``Deployment``'s) for a
    fixture or a test: yielded, then checked to have leaked no block (not
    when the body failed: its own error counts), then stopped."""
    deployment = Deployment(config, actor_classes, backend_cls)
    try:
        yield deployment
        assert deployment.wait_no_leaks() == {}
    finally:
        deployment.stop()


def actor_ids(backend) -> dict[str, str]:
    """The worker actors a RayBackend uses: {worker name: actor id}."""
    workers = backend.prefill.workers + backend.decode.workers
    return {w.name: w.actor._actor_id.hex() for w in workers}


def worker_processes(backend) -> dict[str, tuple[int, int]]:
    """{worker name: (pid, restarts)} from Ray's actor table, each pid checked alive."""
    found = {}
    for name, actor_id in actor_ids(backend).items():
        info = ray_state.actors(actor_id)
        assert info["State"] == "ALIVE", (name, info["State"])
        os.kill(info["Pid"], 0)  # raises if the process is gone
        found[name] = (info["Pid"], info["NumRestarts"])
    return found


@dataclass
class RouterProcess:
    """A router attached to a deployment, in a process of its own."""

    process: subprocess.Popen
    address: str
    workers: dict[str, int]  # the workers it attached to: {name: process id}

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)


@contextlib.contextmanager
def router_process(name: str, start_timeout_s: float = 300) -> Iterator[RouterProcess]:
    """Start a router attached to deployment ``name`` on this test's Ray
    cluster; yield it once it serves; kill it (if still alive) at the end."""
    gcs = ray.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), gcs, name],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], start_timeout_s)
        assert ready, "the router process did not start"
        started = json.loads(proc.stdout.readline())
        yield RouterProcess(proc, started["address"], started["workers"])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
