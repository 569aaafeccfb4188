"""The local Ray cluster of a named deployment: it outlives the router that
started it, as one started by ``ray start`` would, and ``tandem down`` stops
it.

``ensure`` finds the deployment's running cluster from its state file
(tandem_cli/cluster_state.py) or starts one: ``ray start --head --block`` in a
session of its own (so that neither the router's exit nor a Ctrl-C in its
terminal reaches it), on a free port (never Ray's default 6379, Redis's
port), with the dashboard and usage stats off and token authentication on
(a fresh random token unless the environment configures one). ``stop`` ends
exactly that session's processes (the head's GCS, raylet, agents and
workers); never ``ray stop``, which ends every Ray cluster of the machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from tandem_cli import cluster_state, ray_auth
from tandem_cli.cluster_state import ClusterState

log = logging.getLogger(__name__)

REDIS_PORT = 6379  # never the GCS's: Redis (the block index) may listen there
START_TIMEOUT_S = 120.0
ANSWER_WAIT_S = 10.0  # a running cluster's GCS may be slow on a loaded machine
STOP_TIMEOUT_S = 5.0  # then SIGKILL: Ray's GCS lingers on SIGTERM
# The `ray` of this interpreter's environment: the same Ray as the router.
RAY = str(Path(sys.executable).with_name("ray"))
# Ray's output once the head is up (`ray start`, Ray 2.60).
STARTED_LINE = "Ray runtime started"


@dataclass(frozen=True)
class ClusterSpec:
    """What a local cluster offers: as ``serve.init_ray`` sizes it."""

    num_cpus: int
    resources: dict[str, float] = field(default_factory=dict)
    system_config: dict[str, object] = field(default_factory=dict)
    node_ip: str | None = None
    """The head's address (a loopback one when the router binds loopback);
    None: the machine's, as Ray picks it."""


def free_port(host: str) -> int:
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != REDIS_PORT:
            return port


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[3]) == sid:  # state, ppid, pgrp, sid
            pids.append(int(entry.name))
    return pids


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _is_ray_start(pid: int) -> bool:
    """``pid`` is a ``ray start`` process leading its own session (not a
    process that took a dead cluster's pid)."""
    argv = _argv(pid)
    try:
        sid = os.getsid(pid)
    except OSError:
        return False
    return sid == pid and b"start" in argv and any(a.endswith(b"ray") for a in argv)


def _ours(state: ClusterState) -> list[int]:
    """The processes of the recorded cluster's session: all of them while its
    ``ray start`` runs; once it is gone, those that run in its temp dir (Ray's
    daemons and workers left behind), never another program's."""
    pids = session_pids(state.pid)
    if not pids or _is_ray_start(state.pid):
        return pids
    mark = state.temp_dir.encode()
    return [p for p in pids if any(mark in a for a in _argv(p))]


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_running(state: ClusterState) -> bool:
    """The recorded cluster still runs: its ``ray start`` process is alive
    and its GCS port answers."""
    return _is_ray_start(state.pid) and _answers(state.address)


def is_gone(state: ClusterState) -> bool:
    """The recorded cluster's ``ray start`` process is gone (a stale file)."""
    return not _is_ray_start(state.pid)


def _checked(state: ClusterState | None) -> ClusterState | None:
    """``state`` while its cluster runs; None, its leftovers stopped and its
    file removed, when it is gone. A live ``ray start`` whose GCS does not
    answer within ANSWER_WAIT_S is an error, never stopped here: only
    ``tandem down`` stops a deployment's cluster."""
    if state is None:
        return None
    if is_gone(state):
        log.info(
            "deployment %s: its local Ray cluster is gone (pid %d)", state.deployment, state.pid
        )
        _clean(state)
        return None
    deadline = time.monotonic() + ANSWER_WAIT_S
    while not _answers(state.address):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the local Ray cluster of deployment {state.deployment!r} (pid {state.pid}) "
                f"does not answer at {state.address}; `tandem down --deployment "
                f"{state.deployment}` stops it"
            )
        time.sleep(0.5)
    return state


def find(name: str) -> ClusterState | None:
    """The running local cluster of deployment ``name``; None when none is
    recorded or the recorded one is gone (its stale file is removed)."""
    with cluster_state.locked(name):
        return _checked(cluster_state.read(name))


def ensure(name: str, spec: ClusterSpec) -> tuple[ClusterState, bool]:
    """Deployment ``name``'s running local cluster, started when there is
    none (a stale state file is replaced); True when this call started it."""
    with cluster_state.locked(name):
        state = _checked(cluster_state.read(name))
        if state is not None:
            return state, False
        state = _start(name, spec)
        cluster_state.write(state)
        return state, True


def use(state: ClusterState, environ: MutableMapping[str, str] = os.environ) -> None:
    """Give this process the cluster's token, so ``ray.init(address=...)`` joins."""
    if state.token is not None:
        environ.pop(ray_auth.TOKEN_PATH_ENV, None)
        environ[ray_auth.TOKEN_ENV] = state.token
    ray_auth.enable(local=False, environ=environ)


def _cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    ray_auth.enable(local=True, environ=env)  # a fresh token unless one is configured
    return env


def _start_args(spec: ClusterSpec, port: int, temp_dir: str) -> list[str]:
    host = spec.node_ip or "127.0.0.1"
    args = [RAY, "start", "--head", "--block", "--port", str(port), "--temp-dir", temp_dir]
    args += ["--num-cpus", str(spec.num_cpus), "--include-dashboard", "false"]
    args += ["--disable-usage-stats"]
    if spec.node_ip:
        args += ["--node-ip-address", spec.node_ip]
    if spec.resources:
        args += ["--resources", json.dumps(spec.resources)]
    if spec.system_config:
        args += ["--system-config", json.dumps(spec.system_config)]
    # Free ports for what would otherwise take fixed ones (8265, 52365, 10001,
    # ...), so that this cluster never meets another on the machine; the
    # dashboard's (its API; the UI is off) stays on loopback, Ray's default.
    args += ["--dashboard-port", str(free_port("127.0.0.1"))]
    for flag in (
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
        "--ray-client-server-port",
    ):
        args += [flag, str(free_port(host))]
    return args


def _start(name: str, spec: ClusterSpec) -> ClusterState:
    env = _cluster_env()
    host = spec.node_ip or _machine_ip()
    port = free_port(host)
    temp_dir = tempfile.mkdtemp(prefix="tdm-ray-")  # short: Ray's socket paths
    log_file = cluster_state.log_path(name)
    with open(log_file, "w") as out:  # the child keeps its own descriptor
        os.chmod(log_file, 0o600)
        process = subprocess.Popen(
            _start_args(spec, port, temp_dir),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    token = None if ray_auth.configured_token(os.environ) else env[ray_auth.TOKEN_ENV]
    state = ClusterState(name, f"{host}:{port}", spec.node_ip, process.pid, temp_dir, token)
    try:
        _wait_started(process, state, log_file)
    except BaseException:
        _clean(state)
        raise
    log.info("deployment %s: started a local Ray cluster at %s", name, state.address)
    return state


def _machine_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


def _wait_started(process: subprocess.Popen, state: ClusterState, log_file: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with status {process.returncode}: see {log_file}")
        if STARTED_LINE in log_file.read_text(errors="replace") and _answers(state.address):
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"the local Ray cluster did not start in {START_TIMEOUT_S:g} s: see {log_file}"
    )


def stop(name: str) -> bool:
    """Stop deployment ``name``'s local cluster and forget it; False when none
    is recorded."""
    with cluster_state.locked(name):
        state = cluster_state.read(name)
        if state is None:
            return False
        _clean(state)
        return True


def _clean(state: ClusterState) -> None:
    """End the cluster's session (SIGTERM, then SIGKILL for what is left after
    STOP_TIMEOUT_S) and remove its temp dir and state file."""
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10.0)):
        _signal(_ours(state), sig)
        deadline = time.monotonic() + wait_s
        while _ours(state) and time.monotonic() < deadline:
            _reap(state.pid)
            time.sleep(0.1)
    left = _ours(state)
    if left:
        raise RuntimeError(f"processes {left} of the local Ray cluster did not stop")
    shutil.rmtree(state.temp_dir, ignore_errors=True)
    cluster_state.remove(state.deployment)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(pid: int) -> None:
    """Collect ``ray start`` when this process started it (else it stays a zombie)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
