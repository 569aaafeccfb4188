"""A deployment's control-plane owner, and how routers reach it.

``DeploymentOwner`` holds what every router of a deployment must share: the
config the pools were started with (a router that attaches with another
model is refused), the cluster secret (every router of the deployment signs
with it; an attaching router gets it here: Ray's token auth guards the
cluster, no file holds it), and the workers (a ``PoolController``: their
membership, its generation, and every change to them, one at a time).

- A named deployment (``deployment.name``) runs it as a detached Ray actor
  named ``deployment`` in the namespace ``tandem-<name>`` (no CPU, restarted
  by Ray whenever it dies). Its workers are detached named actors in that
  namespace, so they outlive every router; a restarted owner finds them by
  name (``ray.util.list_named_actors``) and keeps its config and secret (Ray
  gives a restarted actor the arguments it was created with).
- An ephemeral deployment (no name) runs the same class in the router's
  process, and its workers die with the router.

``DeploymentClient`` calls either the same way. ``down(name)`` drains and
removes a named deployment (`tandem down`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import ray

from router.autoscaler_lease import LeaderLease, Turn
from router.autoscaler_observe import Load
from router.config import ServeConfig
from router.membership import role_of
from router.pool_controller import Members, PoolController
from router.pool_manager import release_placement
from worker.cpu_binding import CoreLayout

log = logging.getLogger(__name__)

ACTOR_NAME = "deployment"
DOWN_TIMEOUT_S = 120.0  # beyond the drain: stopping the workers
# What a router attaching to a deployment must agree with, and takes from it.
SHARED_FIELDS = {
    "engine": None,  # every field
    "speculative": None,
    "transfer": ("dtype",),
    "pools": ("mode",),
    "routing": ("redis_url",),
}


class DeploymentNotFound(RuntimeError):
    """deployment.attach is set (or `tandem down` was asked) and no deployment of
    that name runs on this Ray cluster."""


class DeploymentMismatch(ValueError):
    """A router attaching with settings other than the deployment's."""


def namespace_of(name: str) -> str:
    return f"tandem-{name}"


@dataclass(frozen=True)
class Joined:
    """What a router attaching gets: the deployment's secret and config (its
    own, with the shared fields the deployment's), or why it is refused."""

    secret: bytes
    config: ServeConfig | None
    refused: str = ""

    def __repr__(self) -> str:  # never the secret
        return f"Joined(refused={self.refused!r})"


def differences(deployed: ServeConfig, joining: ServeConfig) -> list[str]:
    """The shared fields ``joining`` sets to values other than ``deployed``'s."""
    out = []
    for section, names in SHARED_FIELDS.items():
        mine = getattr(joining, section).model_dump(exclude_unset=True)
        theirs = getattr(deployed, section).model_dump()
        for key, value in mine.items():
            if (names is None or key in names) and value != theirs.get(key):
                out.append(f"{section}.{key} is {value!r}, the deployment's {theirs.get(key)!r}")
    return out


def adopted(deployed: ServeConfig, joining: ServeConfig) -> ServeConfig:
    """``joining`` with the shared fields of ``deployed``."""
    sections: dict[str, dict[str, Any]] = {}
    for section, names in SHARED_FIELDS.items():
        theirs = getattr(deployed, section).model_dump()
        sections[section] = theirs if names is None else {k: theirs[k] for k in names}
    pools = deployed.pools
    sections["pools"].update(prefill=pools.prefill, decode=pools.decode)
    sections["routing"]["redis_password"] = deployed.routing.redis_password_value()
    return joining.updated(**sections)


class DeploymentOwner:
    """The deployment's state; a Ray actor (named) or a plain object (ephemeral)."""

    def __init__(
        self,
        name: str | None,
        config: ServeConfig,
        secret: bytes,
        cores: CoreLayout | None = None,
        actor_classes: dict[str, type] | None = None,
    ) -> None:
        config.security.adopt_secret(secret)
        self.name = name
        self.config = config
        self._secret = secret
        namespace = namespace_of(name) if name is not None else None
        self.controller = PoolController(config, namespace, cores, actor_classes)
        self._adopted = name is None  # a named one looks for running workers first
        self._adopting = asyncio.Lock()
        self.lease = LeaderLease()  # which autoscaling router decides

    async def _ready(self) -> PoolController:
        """The controller, once it has taken over the workers that run already."""
        async with self._adopting:
            if not self._adopted:
                ns = namespace_of(self.name)
                names = [
                    a["name"]
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if a.get("namespace") == ns and role_of(a["name"]) is not None
                ]
                if names:
                    log.warning("deployment %s: adopting running workers %s", self.name, names)
                await self.controller.adopt(names)
                self._adopted = True
        return self.controller

    async def join(self, joining: ServeConfig) -> Joined:
        await self._ready()
        if self.name is None:  # the router that made it: its own config
            return Joined(self._secret, joining)
        diffs = differences(self.config, joining)
        if diffs and self._unused():
            # Its first start failed (say, a bad model): nothing runs on the old config.
            log.warning("deployment %s has no worker: taking the new config", self.name)
            self._retake(joining)
            diffs = []
        if diffs:
            what = "; ".join(diffs)
            why = f"refused to attach to deployment {self.name!r}: {what}"
            return Joined(b"", None, why)
        return Joined(self._secret, adopted(self.config, joining))

    def _unused(self) -> bool:
        """No member, no replacement owed, and no change under way (another
        router's first start): no worker runs on the config."""
        controller = self.controller
        membership = controller.membership
        busy = controller.busy()
        return not busy and not membership.members and not membership.owed()

    def _retake(self, joining: ServeConfig) -> None:
        config = for_owner(joining)
        config.security.adopt_secret(self._secret)
        self.config = self.controller.config = config

    async def generation(self) -> str:
        return (await self._ready()).generation()

    async def members(self) -> Members:
        return (await self._ready()).members()

    async def ensure(self, sizes: dict[str, int], timeout_s: float | None) -> Members:
        return await (await self._ready()).ensure(sizes, timeout_s)

    async def grow(self, role: str, n: int, timeout_s: float | None) -> Members:
        return await (await self._ready()).grow(role, n, timeout_s)

    async def shrink(self, role: str, names: list[str]) -> Members:
        return await (await self._ready()).shrink(role, names)

    async def retire(self, role: str, names: list[str]) -> Members:
        return await (await self._ready()).retire(role, names, self.lease.routed)

    async def autoscale_turn(
        self, router_id: str, load: Load, lease_s: float, in_flight: dict[str, int] | None = None
    ) -> Turn:
        """Whether ``router_id`` decides this round (router/autoscaler_lease.py);
        ``in_flight``: its requests in flight per worker."""
        return self.lease.turn(router_id, load, lease_s, in_flight)

    async def autoscale_leave(self, router_id: str) -> None:
        self.lease.leave(router_id)

    async def lost(self, names: list[str]) -> Members:
        return await (await self._ready()).lost(names)

    async def replace_owed(self, timeout_s: float | None) -> Members:
        return await (await self._ready()).replace_owed(timeout_s)

    async def down(self, drain_timeout_s: float) -> list[str]:
        return await (await self._ready()).down(drain_timeout_s)


class DeploymentClient:
    """Calls a deployment's owner: in this process, or its actor through Ray."""

    def __init__(self, owner: Any, remote: bool, name: str | None) -> None:
        self._owner = owner
        self.remote = remote
        self.name = name

    async def call(self, method: str, *args: Any) -> Any:
        if self.remote:
            return await getattr(self._owner, method).remote(*args)
        return await getattr(self._owner, method)(*args)


def open_deployment(
    config: ServeConfig,
    cores: CoreLayout | None = None,
    actor_classes: dict[str, type] | None = None,
) -> DeploymentClient:
    """The owner of ``config``'s deployment: a new one in this process
    (ephemeral), or the named one's actor, created unless it runs (or
    DeploymentNotFound with deployment.attach)."""
    name = config.deployment.name
    secret = config.security.cluster_security().secret
    if name is None:
        owner = DeploymentOwner(None, config, secret, cores, actor_classes)
        return DeploymentClient(owner, False, None)
    namespace = namespace_of(name)
    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=namespace)
    except ValueError:
        if config.deployment.attach:
            raise DeploymentNotFound(
                f"no deployment named {name!r} runs on this Ray cluster (deployment.attach is "
                f"set): start it first without attach"
            ) from None
        # get_if_exists: of two routers creating it at once, both get the one actor.
        actor = (
            ray.remote(DeploymentOwner)
            .options(
                name=ACTOR_NAME,
                namespace=namespace,
                lifetime="detached",
                num_cpus=0,
                max_restarts=-1,
                max_task_retries=-1,
                get_if_exists=True,
                max_concurrency=1000,
            )
            .remote(name, for_owner(config), secret, cores, actor_classes)
        )
    return DeploymentClient(actor, True, name)


def for_owner(config: ServeConfig) -> ServeConfig:
    """``config`` without the router's API and admin keys: a detached owner's
    creation arguments stay in Ray's GCS (a restart gets them again), and it
    needs the engine, pools, transfer and routing settings, not the keys."""
    return config.updated(
        security={"api_keys": [], "admin_keys": [], "api_keys_file": None, "admin_keys_file": None}
    )


def exists(name: str) -> bool:
    try:
        ray.get_actor(ACTOR_NAME, namespace=namespace_of(name))
    except ValueError:
        return False
    return True


def down(name: str, drain_timeout_s: float = 30.0) -> list[str]:
    """Drain (up to ``drain_timeout_s``: until no worker has a request) and
    remove the named deployment: its workers, then its owner actor. Ray must
    be initialized on the deployment's cluster. Returns the workers' names;
    DeploymentNotFound when nothing of that name runs."""
    namespace = namespace_of(name)
    try:
        actor = ray.get_actor(ACTOR_NAME, namespace=namespace)
    except ValueError:
        actor = None
    removed: list[str] = []
    try:
        if actor is not None:
            timeout_s = drain_timeout_s + DOWN_TIMEOUT_S
            removed = ray.get(actor.down.remote(drain_timeout_s), timeout=timeout_s)
    finally:  # a failed drain still leaves nothing of the deployment
        # Workers the owner did not know (created by an owner that died before it
        # recorded them), or did not stop (its drain failed), go too.
        removed += _kill_workers(namespace)
        if actor is not None:
            ray.kill(actor, no_restart=True)
    if actor is None and not removed:
        raise DeploymentNotFound(f"no deployment named {name!r} runs on this Ray cluster")
    return sorted(set(removed))


def _kill_workers(namespace: str) -> list[str]:
    """Kill every worker actor named in ``namespace``; their names."""
    killed = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == namespace and role_of(entry["name"]) is not None:
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            except ValueError:
                continue
            release_placement(entry["name"])
            killed.append(entry["name"])
    return killed
