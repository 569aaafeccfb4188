"""The state file of a named deployment's local Ray cluster: where a later
``tandem serve --deployment NAME`` (or ``tandem down``), in another shell,
finds the cluster an earlier one started.

One JSON file per deployment, ``$XDG_STATE_HOME/tandem/deployments/NAME.json``
(``~/.local/state/...`` without XDG_STATE_HOME), in a directory only its owner
may enter (0700), readable by its owner only (0600): it holds the cluster's
Ray token, as Ray's own ``~/.ray/auth_token`` does. A file that group or
others can read is refused, never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from router.auth import check_private_file

STATE_HOME_ENV = "XDG_STATE_HOME"
# What a deployment name may be (as deployment.name): it names a file.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class ClusterState:
    """A local Ray cluster ``tandem serve`` started for a named deployment."""

    deployment: str
    address: str
    """The GCS, ``host:port``."""
    node_ip: str | None
    """The node's address drivers give ``ray.init`` (None: Ray's choice)."""
    pid: int
    """The ``ray start --block`` process, leader of a session of its own."""
    temp_dir: str
    """Ray's ``--temp-dir`` for this cluster (removed with it)."""
    token: str | None = field(default=None, repr=False)
    """The cluster's Ray token; None when it came from the environment of the
    ``tandem serve`` that started it (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH):
    then later routers need that environment too."""


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get(STATE_HOME_ENV) or str(Path.home() / ".local" / "state")
    return Path(base) / "tandem" / "deployments"


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"deployment name {name!r}: use letters, digits, '_', '.' and '-' only")
    return name


def state_path(name: str, environ: Mapping[str, str] = os.environ) -> Path:
    return state_dir(environ) / f"{check_name(name)}.json"


def _private_dir(environ: Mapping[str, str]) -> Path:
    """The state directory, created 0700; ValueError when group or others
    may enter it."""
    directory = state_dir(environ)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = directory.stat().st_mode & 0o777
    if mode & 0o077:
        raise ValueError(
            f"{directory} is open to group or others (mode {mode:04o}): it holds Ray "
            f"tokens; chmod 700 it"
        )
    return directory


def read(name: str, environ: Mapping[str, str] = os.environ) -> ClusterState | None:
    """The recorded cluster of deployment ``name``; None when there is none.
    ValueError when the file is readable by group or others, or unreadable."""
    path = state_path(name, environ)
    if not path.exists():
        return None
    check_private_file(path, "the deployment state file")
    try:
        state = ClusterState(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a deployment state file ({e}); remove it") from None
    if state.deployment != name:
        raise ValueError(f"{path} records deployment {state.deployment!r}, not {name!r}")
    return state


def write(state: ClusterState, environ: Mapping[str, str] = os.environ) -> Path:
    """Record ``state`` (created 0600, replaced atomically)."""
    directory = _private_dir(environ)
    path = state_path(state.deployment, environ)
    tmp = directory / f".{state.deployment}.json.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f)
    os.replace(tmp, path)
    return path


def remove(name: str, environ: Mapping[str, str] = os.environ) -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path(name, environ).unlink()


def log_path(name: str, environ: Mapping[str, str] = os.environ) -> Path:
    """Where the cluster's ``ray start`` writes its output."""
    return state_dir(environ) / f"{check_name(name)}.log"


@contextlib.contextmanager
def locked(name: str, environ: Mapping[str, str] = os.environ) -> Iterator[None]:
    """Hold the deployment's lock: two commands never start (or stop) its
    cluster at once."""
    directory = _private_dir(environ)
    fd = os.open(directory / f"{check_name(name)}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
