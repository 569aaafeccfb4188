"""``tandem down --deployment NAME``: drain and remove a named deployment's
pools (router/deployment.py, ``down``), then stop the local Ray cluster
``tandem serve`` started for it (tandem_cli/local_cluster.py). With
``--ray-address`` the cluster is the user's: only the pools go."""

from __future__ import annotations

import argparse
import os
import sys

from tandem_cli import cluster_state, local_cluster, ray_auth

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="drain and remove a named deployment's pools")
    p.add_argument("--deployment", required=True, metavar="NAME", help="the deployment's name")
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="the Ray cluster it runs on (default: the local cluster tandem serve started for it)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="S",
        help="longest the workers may finish their requests (%(default)g s)",
    )


def command(args: argparse.Namespace) -> int:
    name = args.deployment
    try:
        cluster_state.check_name(name)
        if not args.drain_timeout >= 0:
            raise ValueError(f"--drain-timeout {args.drain_timeout}: give seconds, at least 0")
        state = None if args.ray_address else cluster_state.read(name)
    except ValueError as e:
        print(f"tandem down: {e}", file=sys.stderr)
        return 2
    if state is not None and not local_cluster.is_running(state):
        # Gone, or not answering: no pools to drain there; stop what is left.
        local_cluster.stop(name)
        print(f"tandem: deployment {name}: its local Ray cluster was not running; cleaned up")
        return 0
    if state is None and not args.ray_address:
        print(
            f"tandem down: no local Ray cluster of deployment {name!r} runs on this machine "
            f"(none recorded in {cluster_state.state_dir()}); give --ray-address for a cluster "
            f"of your own",
            file=sys.stderr,
        )
        return 1
    code = 0
    try:
        removed = _down_pools(name, args.ray_address, state, args.drain_timeout)
        print(f"tandem: deployment {name}: removed {len(removed or [])} workers", flush=True)
    except Exception as e:  # the cluster's own, below, still goes
        print(f"tandem down: deployment {name}: {type(e).__name__}: {e}", file=sys.stderr)
        code = 1
    if state is not None:
        local_cluster.stop(name)
        print(f"tandem: deployment {name}: stopped its local Ray cluster ({state.address})")
    return code


def _down_pools(
    name: str,
    ray_address: str | None,
    state: cluster_state.ClusterState | None,
    drain_timeout_s: float,
) -> list[str] | None:
    """Connect to the deployment's cluster, call ``down`` there, disconnect."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if state is not None:
        local_cluster.use(state)
        ray.init(address=state.address, _node_ip_address=state.node_ip, log_to_driver=False)
    else:
        ray_auth.enable(local=False)
        ray.init(address=ray_address, log_to_driver=False)
    try:
        from router.deployment import down

        return down(name, drain_timeout_s)
    finally:
        ray.shutdown()
