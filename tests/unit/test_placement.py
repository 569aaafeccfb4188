"""Pools are pinned to node types through their actor options, and dead
workers are told apart from slow ones (no Ray started)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from router.config import ServeConfig, WorkerResources
from router.pool_manager import WorkerHandle, WorkerPool, actor_options, engine_config

pytestmark = pytest.mark.unit


def test_custom_resources_and_labels_become_actor_options():
    res = WorkerResources(
        num_cpus=2, resources={"decode_node": 1}, labels={"tandem/pool": "decode"}
    )
    options = actor_options(res, num_gpus=1)
    assert options["num_cpus"] == 2 and options["num_gpus"] == 1
    assert options["resources"] == {"decode_node": 1}
    assert options["label_selector"] == {"tandem/pool": "decode"}
    plain = actor_options(WorkerResources(), num_gpus=0)
    assert plain["resources"] is None and "label_selector" not in plain


def test_workers_with_gpus_run_the_engine_on_cuda():
    config = ServeConfig(dtype="bfloat16", cuda_graphs=True)
    gpu = engine_config(config, config.decode_resources, num_gpus=1)
    assert (gpu.device, gpu.dtype, gpu.cuda_graphs) == ("cuda", "bfloat16", True)
    assert engine_config(config, config.decode_resources, num_gpus=0).device == "cpu"


class _Method:
    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def remote(self):
        async def call():
            if self.outcome == "hang":
                await asyncio.sleep(3600)
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return {}

        return call()


class _Actor:
    def __init__(self, outcome) -> None:
        self.stats = _Method(outcome)


def test_a_pool_runs_its_role_actor_or_the_class_it_was_given():
    from decode_pool.actor import DecodeActor
    from prefill_pool.actor import PrefillActor

    assert WorkerPool("prefill", ServeConfig()).actor_class() is PrefillActor
    assert WorkerPool("decode", ServeConfig()).actor_class() is DecodeActor
    assert WorkerPool("colocated", ServeConfig()).actor_class() is DecodeActor

    class OtherPrefillActor(PrefillActor):
        pass

    pool = WorkerPool("prefill", ServeConfig())
    pool.actor_cls = OtherPrefillActor
    assert pool.actor_class() is OtherPrefillActor


def test_only_workers_whose_actor_died_are_dead():
    pool = WorkerPool("decode", ServeConfig())
    pool.workers = [
        WorkerHandle("alive", "decode", _Actor("ok")),
        WorkerHandle("dead", "decode", _Actor(ray.exceptions.ActorDiedError())),
        WorkerHandle("slow", "decode", _Actor("hang")),
        WorkerHandle(
            "restarting", "decode", _Actor(ray.exceptions.ActorUnavailableError("x", None))
        ),
    ]
    dead = asyncio.run(pool.find_dead(timeout_s=0.2))
    assert [w.name for w in dead] == ["dead"]
    pool.remove(dead)
    assert [w.name for w in pool.workers] == ["alive", "slow", "restarting"]


def test_a_replacement_that_cannot_be_placed_is_tried_again():
    from router.ray_backend import RayBackend

    backend = RayBackend(ServeConfig())
    pool = backend.decode
    survivor, lost = WorkerHandle("d0", "decode", None), WorkerHandle("d1", "decode", None)
    pool.workers = [survivor, lost]
    deaths = [[lost], []]
    placeable = [False, True]
    forgotten, subscribed = [], []

    async def find_dead(timeout_s):
        return [w for w in deaths.pop(0) if w in pool.workers]

    async def scale_to(n, timeout_s=None):
        if not placeable.pop(0):
            raise TimeoutError("no node offers decode_node")
        new = [
            WorkerHandle(f"d{len(pool.workers) + i + 1}", "decode", None)
            for i in range(n - len(pool.workers))
        ]
        pool.workers += new
        return new

    async def no_prefill_deaths(timeout_s):
        return []

    async def worker_down(worker):
        forgotten.append(worker.name)

    async def subscribe(worker):
        subscribed.append(worker.name)

    pool.find_dead, pool.scale_to = find_dead, scale_to
    backend.prefill.find_dead = no_prefill_deaths
    backend._worker_down, backend.streams.subscribe = worker_down, subscribe

    assert asyncio.run(backend.replace_dead_workers()) == ["d1"]
    assert [w.name for w in pool.workers] == ["d0"] and forgotten == ["d1"]
    assert subscribed == []  # nothing placed yet
    assert asyncio.run(backend.replace_dead_workers()) == []
    assert len(pool.workers) == 2 and subscribed == [pool.workers[1].name]
