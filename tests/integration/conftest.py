"""Integration fixtures: one local Ray cluster per test session, on loopback."""

from __future__ import annotations

import os

import pytest

RAY_NODE_IP = "127.0.0.2"  # ray.init rewrites 127.0.0.1 to the interface address


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=8,  # logical slots for the worker actors; 2 real cores are shared
        _node_ip_address=RAY_NODE_IP,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster_certs(tmp_path_factory):
    """(the cluster's CA and leaf, a stranger's: another CA and its leaf)."""
    from tests.tls_certs import make_certs, openssl_available

    if not openssl_available():
        pytest.skip("the openssl command is not installed")
    root = tmp_path_factory.mktemp("tls")
    return make_certs(root, "cluster"), make_certs(root, "stranger")
