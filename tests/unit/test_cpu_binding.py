"""worker.cpu_binding: the core layout of one machine and how pools share it
out (binding a process's threads: test_sched_policy.py)."""

from __future__ import annotations

import asyncio

import pytest

from router.config import ServeConfig, WorkerResources
from tandem_cli.serve import plan_cores
from worker.cpu_binding import CoreAssignment, CoreLayout, available_cores, plan_layout

pytestmark = pytest.mark.unit


def test_decode_workers_get_the_highest_cores_and_the_rest_is_shared():
    assert plan_layout([0, 1], decode_workers=1, threads=1) == CoreLayout((0,), ((1,),), (0, 1))
    layout = plan_layout(range(8), decode_workers=2, threads=2)
    assert layout == CoreLayout((0, 1, 2, 3), ((4, 5), (6, 7)), tuple(range(8)))
    # A container's or taskset's cores need not be contiguous.
    layout = plan_layout({7, 2, 5, 0}, decode_workers=1, threads=2)
    assert layout == CoreLayout((0, 2), ((5, 7),), (0, 2, 5, 7))
    assert "cores 4-5, cores 6-7" in plan_layout(range(8), 2, 2).describe()


@pytest.mark.parametrize(
    ("cores", "workers", "threads"), [(1, 1, 1), (2, 2, 1), (4, 2, 2), (4, 0, 1)]
)
def test_no_layout_when_no_core_would_be_left_shared(cores, workers, threads):
    assert plan_layout(range(cores), workers, threads) is None


def test_decode_sets_are_handed_out_once_and_come_back():
    layout = plan_layout(range(4), decode_workers=2, threads=1)
    decode = CoreAssignment(layout, "decode")
    assert decode.claim("d0") == (2,)
    assert decode.claim("d1") == (3,)
    # Beyond the plan: every core, not the shared ones the router crowds.
    assert decode.claim("d2") == (0, 1, 2, 3)
    decode.release("d0")
    decode.release("d2")  # held no set of its own: nothing changes
    assert decode.claim("d3") == (2,)
    assert decode.claim("d4") == (0, 1, 2, 3)
    prefill = CoreAssignment(layout, "prefill")
    assert prefill.claim("p0") == prefill.claim("p1") == (0, 1)


def test_serve_plans_only_for_a_local_cpu_cluster():
    cpu = ServeConfig(pools={"decode_resources": WorkerResources(num_gpus=0)})
    expected = plan_layout(available_cores(), 1, 1)
    assert plan_cores(cpu) == expected
    assert plan_cores(cpu.updated(pools={"cpu_binding": False})) is None
    assert plan_cores(cpu.updated(pools={"ray_address": "127.0.0.1:6380"})) is None
    gpu = ServeConfig(pools={"decode_resources": {"num_gpus": 1}})
    assert plan_cores(gpu) is None


def test_a_pool_whose_actor_cannot_be_created_frees_its_cores(monkeypatch):
    """The deployment's controller: the second actor fails to be created; the
    first is killed and neither keeps its decode core."""
    from router import pool_manager
    from router.pool_controller import PoolController

    layout = plan_layout(range(4), decode_workers=2, threads=1)
    config = ServeConfig(pools={"decode": 2, "decode_resources": {"num_gpus": 0}})
    controller = PoolController(config, cores=layout)
    created, killed = [], []

    class ActorClass:
        def options(self, **_):
            return self

        def remote(self, *_, cpu_cores, **__):
            if created:
                raise RuntimeError("no actor")
            created.append(cpu_cores)
            return object()

    monkeypatch.setattr(pool_manager.ray, "remote", lambda cls: ActorClass())
    monkeypatch.setattr(pool_manager.ray, "kill", killed.append)
    with pytest.raises(RuntimeError, match="no actor"):
        asyncio.run(controller.ensure({"decode": 2}, None))
    assert created == [(2,)] and len(killed) == 1 and controller.members().workers == ()
    assert controller.cores["decode"].claim("d-next") == (2,)
    assert controller.cores["decode"].claim("d-after") == (3,)


def test_gpus_are_seen_through_the_driver_and_hidden_by_cuda_visible_devices(monkeypatch, tmp_path):
    from worker import cpu_binding

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    real_path = cpu_binding.Path

    def fake_path(p):
        mapped = {"/proc/driver/nvidia/gpus": gpus, "/dev/nvidia0": tmp_path / "none"}
        return real_path(mapped.get(p, p))

    monkeypatch.setattr(cpu_binding, "Path", fake_path)
    assert not cpu_binding.nvidia_gpus_visible()  # a driver with no GPU listed
    (gpus / "0000:01:00.0").mkdir()
    assert cpu_binding.nvidia_gpus_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not cpu_binding.nvidia_gpus_visible()
