"""A multi-node Ray cluster on one machine: every node its own ``ray start``
process on its own loopback address (127.0.0.2, .3, ...; ``ray.init()`` would
swap 127.0.0.1 for the machine's interface address), the head on a free port
rather than Ray's default 6379, and ``RAY_AUTH_MODE=token`` with one token in
every process of the cluster (Ray 2.60 refuses a second node without it), so
a test can stop one node and keep the others.

Each node is started with ``--block`` in a session of its own; stopping a
node ends that session's processes (its raylet, agents and workers) and
nothing else, so other Ray clusters on the machine are never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tandem_cli.local_cluster import session_pids

# The `ray` of this interpreter's environment, so nodes run the same Ray and
# import the same project as the test.
RAY = str(Path(sys.executable).with_name("ray"))


def ray_cli_available() -> bool:
    return Path(RAY).exists()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _signal_session(sid: int, sig: int) -> None:
    for pid in session_pids(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class Node:
    ip: str
    process: subprocess.Popen  # `ray start --block`, leader of its own session

    @property
    def alive(self) -> bool:
        return bool(session_pids(self.process.pid))


class LocalRayCluster:
    """Head on ``head_ip``; ``add_node`` joins more. Always ``stop()`` it."""

    def __init__(self, head_ip: str = "127.0.0.2", log_dir: Path | None = None) -> None:
        self.head_ip = head_ip
        self.port = _free_port(head_ip)
        self.address = f"{head_ip}:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="tdm-ray-")  # short: unix socket paths
        self.log_dir = Path(log_dir or self.temp_dir)
        # Every process of the cluster (nodes and drivers) needs the same token.
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Notice a stopped node within a couple of seconds.
            "RAY_health_check_period_ms": "500",
            "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_initial_delay_ms": "0",
        }
        self.nodes: list[Node] = []

    def start_head(self, num_cpus: int = 0) -> Node:
        return self._start(
            self.head_ip,
            [
                "--head",
                "--port",
                str(self.port),
                "--temp-dir",
                self.temp_dir,
                "--include-dashboard",
                "false",
                "--num-cpus",
                str(num_cpus),
            ],
        )

    def add_node(
        self,
        ip: str,
        num_cpus: int,
        resources: dict[str, float],
        labels: dict[str, str] | None = None,
    ) -> Node:
        args = ["--address", self.address, "--num-cpus", str(num_cpus)]
        args += ["--resources", json.dumps(resources)]
        if labels:
            args += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        return self._start(ip, args)

    def _start(self, ip: str, args: list[str]) -> Node:
        # Free ports for what would otherwise take fixed ones, so this cluster
        # never meets another on the machine.
        for flag in (
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
        ):
            args += [flag, str(_free_port(ip))]
        if "--head" in args:
            args += ["--ray-client-server-port", str(_free_port(ip))]
        log = open(self.log_dir / f"ray-{ip}.log", "w")  # noqa: SIM115 (the node keeps it)
        process = subprocess.Popen(
            [RAY, "start", "--block", "--node-ip-address", ip, "--disable-usage-stats", *args],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        node = Node(ip, process)
        self.nodes.append(node)
        return node

    def wait_for_nodes(self, n: int, timeout_s: float = 180.0) -> None:
        """Until ``n`` nodes are alive in the cluster (asked with `ray status`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"ray node {node.ip} exited: see {self.log_dir}")
            status = subprocess.run(
                [RAY, "status", "--address", self.address],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if status.returncode == 0 and active.count("node_") >= n:
                return
            time.sleep(1.0)
        raise TimeoutError(f"{n} ray nodes did not come up in {timeout_s} s")

    def stop_node(self, node: Node, timeout_s: float = 30.0) -> None:
        """Stop one node (like `ray stop` there) and wait until its processes are gone."""
        sid = node.process.pid
        _signal_session(sid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        node.process.wait(timeout=5)

    def stop(self) -> None:
        """Stop every node, head last; kills what does not stop in time."""
        for node in reversed(self.nodes):
            _signal_session(node.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(n.alive for n in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in self.nodes:
            _signal_session(node.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
