"""Pools are pinned to node types through their actor options, and dead
workers are told apart from slow ones (no Ray started)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from protocol.workers import WorkerHealth
from router.config import EngineSection, ServeConfig, WorkerResources
from router.pool_manager import WorkerHandle, WorkerPool, actor_options

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
    config = ServeConfig(engine={"dtype": "bfloat16", "cuda_graphs": True})
    gpu = config.engine_config("decode", num_gpus=1)
    assert (gpu.device, gpu.dtype, gpu.cuda_graphs) == ("cuda", "bfloat16", True)
    assert config.engine_config("decode", num_gpus=0).device == "cpu"


def test_the_engine_section_is_the_workers_engine_config():
    """Every engine setting reaches the workers' EngineConfig; the pools give
    each role its threads."""
    engine = {
        "model": "/m/x",
        "tokenizer": "/t/x",
        "load_format": "dummy",
        "dtype": "float16",
        "block_size": 32,
        "kv_cache_memory_mb": 48,
        "max_num_batched_tokens": 1024,
        "max_num_seqs": 8,
        "max_model_len": 300,
        "enable_prefix_caching": False,
        "cpu_kernels": "off",
        "greedy_screen": False,
        "cuda_graphs": True,
    }
    config = ServeConfig(
        engine=engine,
        pools={"prefill_resources": {"num_threads": 3}, "decode_resources": {"num_threads": 2}},
        transfer={"dtype": "int8"},
    )
    assert set(engine) == set(EngineSection.model_fields)  # the test covers every field
    for role, threads in (("prefill", 3), ("decode", 2), ("colocated", 2)):
        ec = config.engine_config(role, num_gpus=0)
        got = {k: getattr(ec, k) for k in engine if k != "kv_cache_memory_mb"}
        assert got == {k: v for k, v in engine.items() if k != "kv_cache_memory_mb"}
        assert ec.kv_cache_memory_bytes == 48 << 20
        assert (ec.num_threads, ec.device, ec.kv_transfer_dtype) == (threads, "cpu", "int8")


def test_the_transfer_and_security_sections_make_the_transfer_config():
    config = ServeConfig(
        transfer={
            "lease_s": 7,
            "timeout_s": 9,
            "max_message_mb": 20,
            "local_output_streams": False,
        },
        security={"cluster_secret": "s"},
    )
    tc = config.transfer_config()
    assert (tc.lease_s, tc.timeout_s, tc.max_message_bytes) == (7, 9, 20 << 20)
    assert tc.local_streams is False and tc.security.secret == b"s"


class _Method:
    def __init__(self, outcome) -> None:
        self.outcome = outcome

    def remote(self):
        async def call():
            if self.outcome == "hang":
                await asyncio.sleep(3600)
            if isinstance(self.outcome, Exception):
                raise self.outcome
            return WorkerHealth("w", "first", True, 10, 10, 0)

        return call()


class _Actor:
    def __init__(self, outcome) -> None:
        self.health = _Method(outcome)


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


def test_a_dead_worker_leaves_routing_while_a_scale_waits_for_placement():
    """The scale lock is held while Ray places a scale's workers; a worker that
    dies meanwhile is taken out of routing at once, and replaced once the scale
    is done."""
    from router.ray_backend import RayBackend

    backend = RayBackend(ServeConfig())
    pool = backend.decode
    lost = WorkerHandle("d1", "decode", None)
    pool.workers = [WorkerHandle("d0", "decode", None), lost]
    forgotten, subscribed = [], []

    async def body():
        placing, waiting = asyncio.Event(), asyncio.Event()
        made = iter(range(2, 100))

        async def scale_to(n, timeout_s=None):  # as WorkerPool's: counts, then starts
            new = [
                WorkerHandle(f"d{next(made)}", "decode", None) for _ in range(n - len(pool.workers))
            ]
            if not waiting.is_set():  # the scale's placement: Ray takes its time
                waiting.set()
                await placing.wait()
            pool.workers += new
            return new

        async def find_dead(timeout_s):
            return [w for w in pool.workers if w is lost]

        async def no_prefill_deaths(timeout_s):
            return []

        async def worker_down(worker):
            forgotten.append(worker.name)

        async def subscribe(worker):
            subscribed.append(worker.name)

        pool.find_dead, pool.scale_to = find_dead, scale_to
        backend.prefill.find_dead = no_prefill_deaths
        backend._worker_down, backend.streams.subscribe = worker_down, subscribe

        scale = asyncio.ensure_future(backend.scale(None, 3, 0.0))
        await waiting.wait()
        # Not blocked by the scale's lock (the bound only keeps a regression from hanging).
        dropped = await asyncio.wait_for(backend.replace_dead_workers(), 60)
        assert dropped == ["d1"] and forgotten == ["d1"]
        assert [w.name for w in pool.workers] == ["d0"] and not scale.done()
        placing.set()
        await scale
        assert len(pool.workers) == 2  # the scale's one new worker; d1 is still missing
        assert await backend.replace_dead_workers() == []
        assert len(pool.workers) == 3 and lost not in pool.workers
        assert len(subscribed) == 2

    asyncio.run(body())
