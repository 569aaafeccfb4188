"""Pools are pinned to node types through their actor options, and dead
workers are told apart from slow ones (no Ray started)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from protocol.workers import WorkerHealth, WorkerInfo
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
        "matrix_units": False,
        "cuda_graphs": True,
        "attention": "sdpa",
        "quantization": "int8",
        "simulate": None,  # refused with int8 (test below)
        "kv_tier_mb": 5,
        "kv_tier_dir": "/tier/x",
        "deterministic": False,  # refused with int8 transfer; passed through: test_deterministic
    }
    config = ServeConfig(
        engine=engine,
        pools={"prefill_resources": {"num_threads": 3}, "decode_resources": {"num_threads": 2}},
        transfer={"dtype": "int8"},
    )
    assert set(engine) == set(EngineSection.model_fields)  # the test covers every field
    for role, threads in (("prefill", 3), ("decode", 2), ("colocated", 2)):
        ec = config.engine_config(role, num_gpus=0)
        in_mb = {"kv_cache_memory_mb", "kv_tier_mb"}
        got = {k: getattr(ec, k) for k in engine if k not in in_mb}
        assert got == {k: v for k, v in engine.items() if k not in in_mb}
        assert (ec.kv_cache_memory_bytes, ec.kv_tier_memory_bytes) == (48 << 20, 5 << 20)
        assert (ec.num_threads, ec.device, ec.kv_transfer_dtype) == (threads, "cpu", "int8")


def test_the_simulate_option_reaches_every_workers_engine():
    config = ServeConfig(engine={"simulate": "llama-3.1-8b-h200"})
    for role in ("prefill", "decode"):
        assert config.engine_config(role, num_gpus=0).simulate == "llama-3.1-8b-h200"


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
    from router.pool_manager import actor_class

    assert actor_class("prefill") is PrefillActor
    assert actor_class("decode") is DecodeActor
    assert actor_class("colocated") is DecodeActor

    class OtherPrefillActor(PrefillActor):
        pass

    assert actor_class("prefill", OtherPrefillActor) is OtherPrefillActor


def test_only_workers_whose_actor_died_are_dead():
    pool = WorkerPool("decode")
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


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        async def call():
            return self.fn(*args)

        return call()


class _Owned:
    """A backend whose ephemeral deployment's owner creates fake workers:
    ``placeable`` says, start by start, whether Ray places them; ``dead``
    holds the names whose actor died for good."""

    def __init__(self, monkeypatch, placeable: list[bool]) -> None:
        from router import pool_controller
        from router.deployment import DeploymentClient, DeploymentOwner
        from router.health import Health
        from router.ray_backend import RayBackend

        self.placeable, self.dead = placeable, set()
        self.forgotten, self.subscribed, self.places = [], [], 0

        def create(config, role, name, cls, namespace, cores):
            info = WorkerInfo(name, 64, 100, "fp", "inc", "/m")
            return WorkerHandle(name, role, type("A", (), {"info": _Remote(lambda: info)})())

        async def start(workers, timeout_s):
            self.places += 1
            if not self.placeable.pop(0):
                raise TimeoutError("no node offers decode_node")
            for w in workers:
                w.info = WorkerInfo(w.name, 64, 100, "fp", "inc", "/m")

        async def check(worker, timeout_s):
            return Health.DEAD if worker.name in self.dead else Health.HEALTHY

        monkeypatch.setattr(pool_controller, "create_worker", create)
        monkeypatch.setattr(pool_controller, "start_workers", start)
        monkeypatch.setattr(pool_controller.health, "check", check)
        self.backend = b = RayBackend(ServeConfig())
        b.deployment = DeploymentClient(DeploymentOwner(None, b.config, b"s" * 32), False, None)

        async def worker_down(worker):
            self.forgotten.append(worker.name)

        async def subscribe(worker):
            self.subscribed.append(worker.name)

        async def find_dead(timeout_s):
            return [w for w in b.decode.workers if w.name in self.dead]

        async def no_prefill_deaths(timeout_s):
            return []

        b.changes.worker_down, b.streams.subscribe = worker_down, subscribe
        b.decode.find_dead, b.prefill.find_dead = find_dead, no_prefill_deaths

    async def start(self, decode: int) -> None:
        b = self.backend
        members = await b.deployment.call("ensure", {"prefill": 1, "decode": decode}, None)
        await b.members.connect(members)
        await b.members.join_all()
        self.subscribed.clear()

    def names(self) -> list[str]:
        return [w.name for w in self.backend.decode.workers]


def test_a_replacement_that_cannot_be_placed_is_tried_again(monkeypatch):
    owned = _Owned(monkeypatch, [True, False, True])
    backend = owned.backend

    async def body():
        await owned.start(2)
        survivor, lost = owned.names()
        owned.dead.add(lost)
        assert await backend.replace_dead_workers() == [lost]
        assert owned.names() == [survivor] and owned.forgotten[0] == lost
        assert owned.subscribed == []  # nothing placed yet
        assert await backend.replace_dead_workers() == []
        assert len(owned.names()) == 2 and owned.subscribed == [owned.names()[1]]
        assert lost not in owned.names()
        assert await backend.replace_dead_workers() == []  # nothing owed: nothing placed
        assert owned.places == 3

    asyncio.run(body())


def test_a_dead_worker_leaves_routing_while_a_scale_waits_for_placement(monkeypatch):
    """A scale holds the deployment's lock while Ray places its workers; a
    worker that dies meanwhile is taken out of routing at once, and replaced
    once the scale is done."""
    owned = _Owned(monkeypatch, [True, True, True])
    backend = owned.backend

    async def body():
        from router import pool_controller

        await owned.start(2)
        placing, waiting = asyncio.Event(), asyncio.Event()
        start = pool_controller.start_workers

        async def slow_start(workers, timeout_s):
            if not waiting.is_set():  # the scale's placement: Ray takes its time
                waiting.set()
                await placing.wait()
            await start(workers, timeout_s)

        monkeypatch.setattr(pool_controller, "start_workers", slow_start)
        scale = asyncio.ensure_future(backend.scale(None, 3, 0.0))
        await waiting.wait()
        lost = owned.names()[1]
        owned.dead.add(lost)
        replacing = asyncio.ensure_future(backend.replace_dead_workers())
        for _ in range(100):  # out of routing without waiting for the scale
            await asyncio.sleep(0.01)
            if lost not in owned.names():
                break
        assert lost not in owned.names() and not scale.done()
        placing.set()
        await scale
        assert await asyncio.wait_for(replacing, 60) == [lost]
        assert len(owned.names()) == 3 and lost not in owned.names()
        assert len(owned.subscribed) == 2  # the scale's new worker and the replacement

    asyncio.run(body())
