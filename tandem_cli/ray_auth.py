"""Ray's token authentication, on for every cluster ``tandem serve`` starts
or joins: without it, anyone who reaches the Ray ports runs code in the
cluster (and reads the cluster secret the workers hold).

A local cluster without a configured token gets a random one in the
environment its processes inherit: never a file, a flag or a log line. A
cluster joined at ``pools.ray_address`` must have token authentication on;
its token comes from ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH`` (a
Kubernetes Secret in infra/kuberay, the environment of ``ray up``'s nodes in
infra/ray).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, MutableMapping

from router.auth import check_private_file

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"


def enable(local: bool, environ: MutableMapping[str, str] = os.environ) -> None:
    """Turn token authentication on in ``environ`` (this process's, by
    default: Ray reads it); ``local``: a cluster this process starts, which
    gets a fresh token unless one is configured. ValueError when the
    environment turns it off, or names a token file (``RAY_AUTH_TOKEN_PATH``)
    that group or others can read."""
    mode = environ.get(MODE_ENV)
    if mode is not None and mode.lower() != "token":
        raise ValueError(
            f"{MODE_ENV}={mode}: tandem runs Ray with token authentication only "
            f"(unset {MODE_ENV} or set it to token)"
        )
    environ[MODE_ENV] = "token"
    check_token_file(environ)
    if local and not configured_token(environ):
        environ[TOKEN_ENV] = secrets.token_hex(32)
    if environ is os.environ:
        _reload_ray_config()


def configured_token(environ: Mapping[str, str] = os.environ) -> bool:
    """The environment gives a token (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``)."""
    return bool(environ.get(TOKEN_ENV) or environ.get(TOKEN_PATH_ENV))


def check_token_file(environ: Mapping[str, str] = os.environ) -> None:
    """ValueError when ``RAY_AUTH_TOKEN_PATH`` names a file that group or
    others can read (a missing one is left to Ray, whose error says so)."""
    path = environ.get(TOKEN_PATH_ENV)
    if path and os.path.exists(path):
        check_private_file(path, TOKEN_PATH_ENV)


def _reload_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE once, when it is imported: read it again (as
    Ray's own ``ray.init`` does when it turns token mode on itself)."""
    from ray._raylet import Config

    Config.initialize("")
