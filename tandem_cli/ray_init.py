"""How ``tandem serve`` reaches Ray: the user's cluster at ``pools.ray_address``;
for a named deployment, a local cluster of its own that outlives the router
(tandem_cli/local_cluster.py); else a local cluster in the router's process,
which stops with it.

Ray's token authentication is on in every case (tandem_cli/ray_auth.py).
"""

from __future__ import annotations

import ipaddress
import math
import os

from router.config import ServeConfig
from tandem_cli import local_cluster, ray_auth
from tandem_cli.local_cluster import ClusterSpec

# ray.init() swaps 127.0.0.1 (and "localhost") for the machine's interface
# address; another loopback address keeps a local cluster on loopback.
LOCAL_RAY_NODE_IP = "127.0.0.2"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ray_is_up() -> bool:
    import ray

    return ray.is_initialized()


def cluster_spec(config: ServeConfig) -> ClusterSpec:
    """A local cluster sized for the pools: every CPU of the machine, or what
    the pools ask for when that is more; their custom resources; on loopback
    when the router binds a loopback host."""
    pools_config = config.pools
    pools = [(pools_config.decode, pools_config.decode_resources)]
    if pools_config.mode == "disaggregated":
        pools.append((pools_config.prefill, pools_config.prefill_resources))
    needed_cpus = sum(n * r.tensor_parallel_size * r.num_cpus for n, r in pools)
    custom: dict[str, float] = {}
    for n, r in pools:
        for name, amount in r.resources.items():
            custom[name] = custom.get(name, 0.0) + n * r.tensor_parallel_size * amount
    system: dict[str, object] = {}
    if pools_config.worker_niceness is not None:
        # Workers start at it and need no privilege to keep it (each one also
        # sets it itself: sched_policy.set_niceness); below 0 only they can try.
        system["worker_niceness"] = max(pools_config.worker_niceness, 0)
    return ClusterSpec(
        num_cpus=max(os.cpu_count() or 1, math.ceil(needed_cpus)),
        resources=custom,
        system_config=system,
        node_ip=LOCAL_RAY_NODE_IP if is_loopback(config.server.host) else None,
    )


def init_ray(config: ServeConfig) -> bool:
    """Connect this process to Ray (see the module's docstring). Returns True
    when this call connected it (the caller then calls ``ray.shutdown()``,
    which stops only an in-process cluster: a named deployment's and the
    user's keep running)."""
    import ray

    if ray_is_up():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    pools = config.pools
    if pools.ray_address:
        ray_auth.enable(local=False)
        ray.init(address=pools.ray_address)
        return True
    spec = cluster_spec(config)
    name = config.deployment.name
    if name is None:
        ray_auth.enable(local=True)
        ray.init(
            num_cpus=spec.num_cpus,
            resources=spec.resources or None,
            include_dashboard=False,
            _node_ip_address=spec.node_ip,
            _system_config=spec.system_config or None,
        )
        return True
    if config.deployment.attach:
        state = local_cluster.find(name)
        if state is None:
            raise RuntimeError(
                f"deployment.attach: no local Ray cluster of deployment {name!r} runs on this "
                f"machine; start it first without --attach, or give --ray-address"
            )
    else:
        state, _ = local_cluster.ensure(name, spec)
    local_cluster.use(state)
    ray.init(address=state.address, _node_ip_address=state.node_ip)
    return True
