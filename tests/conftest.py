"""Shared fixtures: offline random-weight checkpoints of real configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if "PYTEST_XDIST_WORKER" in os.environ:
    # Two xdist workers share the cores, and some tests ask for 2 torch threads
    # (test_deterministic.py): OpenMP threads that spin at each barrier while
    # a thread of theirs waits for a core waste it; they sleep instead. Read
    # when torch loads OpenMP, so before the import.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Torch threads: 2 (the CI machine's cores) in one process; under pytest-xdist
# the cores shared among its workers (more threads than cores slows every
# test down). TANDEM_TEST_THREADS sets it.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(
    int(os.environ.get("TANDEM_TEST_THREADS") or max(1, min(2, (os.cpu_count() or 2) // _workers)))
)

# Without a GPU, Triton kernels (engine/gpu/) run under Triton's interpreter on
# CPU tensors; Triton reads this when it is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests set their own API keys and cluster secrets; ones exported in the caller's
# shell would leak into every in-process deployment and Ray worker.
for _name in ("TANDEM_API_KEYS", "TANDEM_API_KEY", "TANDEM_CLUSTER_SECRET"):
    os.environ.pop(_name, None)

# The suite runs on the random tiny model: `model` None (EngineConfig, LLM(), a
# ServeConfig without engine.model) means it in this process, its subprocesses
# and Ray workers. Tests about the real default model name SmolLM2 themselves.
os.environ["TANDEM_DEFAULT_MODEL"] = "tandem-tiny-llama"


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """checkpoint(arch, **config_overrides) -> a checkpoint dir, built once per session."""
    from engine.default_model import make_random_checkpoint, tiny_config

    built: dict[tuple, Path] = {}

    def checkpoint(arch: str, **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            built[key] = make_random_checkpoint(out, tiny_config(arch, **overrides), seed=1)
        return built[key]

    return checkpoint


@pytest.fixture(scope="session")
def llama_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama")


# A throwaway redis-server per test (tests that stop or restart Redis use it).
from tests.redis_server import redis_server  # noqa: E402, F401


def pytest_collection_modifyitems(config, items):
    """Every test carries its folder's marker (tests/unit: ``unit``,
    tests/integration: ``integration``), and not the other: the Makefile's
    tiers select by marker, so an unmarked unit test would leave the fast
    tier unnoticed."""
    wrong = []
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        other = {"unit": "integration", "integration": "unit"}.get(folder)
        if other is None:
            continue
        if item.get_closest_marker(folder) is None or item.get_closest_marker(other):
            wrong.append(item.nodeid)
    if wrong:
        raise pytest.UsageError(
            f"tests not marked as their folder says (pytestmark = pytest.mark.<folder>): {wrong}"
        )
