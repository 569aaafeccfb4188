"""Named deployments: detached workers that several routers share and that
outlive each router (router/deployment.py).

One deployment (1 prefill, 1 decode worker) through the module: two routers
serve on the same worker processes, greedy output equal to the engine alone; a
router stopped leaves the workers serving the other; a new router of the
same name attaches without starting workers and hits the prefix cached
before; a killed worker is replaced with the default config (also one killed
while no router runs: the next router starts anyway); ``down``
removes the workers and the deployment's actor. Free blocks back to their
start after each test.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import grpc
import pytest
import ray

from benchkit.deployment import Deployment
from engine import LLM
from engine.default_model import default_model_path
from protocol.sampling import SamplingParams
from router import deployment as dep_mod
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import router_process, worker_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = f"test-{secrets.token_hex(4)}"
MAX_TOKENS = 16
TEXTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. " * 6]
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
CONFIG = ServeConfig(
    engine={"kv_cache_memory_mb": 32},
    transfer={"lease_s": 120},  # blocks must come back through the abort paths
    deployment={"name": NAME},
)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {t: out.token_ids for t, out in zip(TEXTS, llm.generate(TEXTS, params), strict=True)}


@pytest.fixture(scope="module")
def routers(ray_cluster):
    """Routers started by the tests (by name); the deployment goes down at the end."""
    started: dict[str, Deployment] = {}
    yield started
    for router in started.values():
        router.stop()
    if dep_mod.exists(NAME):
        dep_mod.down(NAME, drain_timeout_s=5)


def _actor_ids(router: Deployment) -> dict[str, int]:
    """The router's workers' process ids, by name (a worker Ray restarted keeps
    its actor id, not its process)."""
    b = router.backend
    workers = b.prefill.workers + b.decode.workers
    return {w.name: ray.get(w.actor.pid.remote()) for w in workers}


async def _complete(address: str, prompts):
    async with TandemClient(address) as client:
        return await asyncio.gather(*(client.complete(p, **GREEDY) for p in prompts))


def _serves(router: Deployment, reference) -> list:
    outs = asyncio.run(_complete(router.address, TEXTS))
    assert [o.token_ids for o in outs] == [reference[t] for t in TEXTS]
    assert router.wait_no_leaks() == {}
    return outs


def _wait(pred, timeout_s: float = 180.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return pred()


def _workers_in_namespace() -> set[str]:
    ns = dep_mod.namespace_of(NAME)
    return {
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == ns
    }


def test_attach_without_a_running_deployment_is_refused(ray_cluster):
    config = CONFIG.updated(deployment={"name": f"none-{secrets.token_hex(3)}", "attach": True})
    with pytest.raises(dep_mod.DeploymentNotFound, match="no deployment named"):
        Deployment(config)


def test_a_bare_attach_serves_as_the_deployment(ray_cluster, reference):
    """A router given only the name takes the deployment's mode, model, block size
    and secret: it serves a colocated pool, lists the deployment's model, and its
    cache salts are the first router's (the prefix cached through one hits
    through the other)."""
    name = f"bare-{secrets.token_hex(3)}"
    model = str(default_model_path())  # the default model, named otherwise
    first = CONFIG.updated(
        engine={"model": model, "block_size": 32},
        pools={"mode": "colocated", "decode": 1},
        server={"http_port": 8000},
        deployment={"name": name},
    )
    bare = ServeConfig(server={"http_port": 8000}, deployment={"name": name, "attach": True})
    started = []
    try:
        started.append(a := Deployment(first))
        started.append(b := Deployment(bare))
        assert b.backend.colocated and b.backend.block_size == 32
        assert b.backend.model_name == b.server.http.state.model_name == model
        assert b.server.lifecycle.cache_domains.key == a.server.lifecycle.cache_domains.key
        _serves(a, reference)
        outs = _serves(b, reference)
        assert outs[1].usage.cached_tokens > 0  # cached through a, same salt
    finally:
        for router in started:
            router.stop()
        dep_mod.down(name, drain_timeout_s=5)


def test_two_routers_share_the_workers(routers, reference):
    routers["a"] = Deployment(CONFIG)
    routers["b"] = Deployment(CONFIG.updated(deployment={"attach": True}))
    a, b = routers["a"], routers["b"]
    assert _actor_ids(a) == _actor_ids(b) and len(_actor_ids(a)) == 2
    assert _workers_in_namespace() == {"deployment", *_actor_ids(a)}
    _serves(a, reference)
    _serves(b, reference)


def test_another_model_is_refused(routers):
    other = CONFIG.updated(engine={"block_size": 32}, deployment={"attach": True})
    with pytest.raises(dep_mod.DeploymentMismatch, match=r"engine\.block_size"):
        Deployment(other)


def test_a_router_stopped_leaves_the_workers_serving_the_other(routers, reference):
    ids = _actor_ids(routers["a"])
    routers.pop("b").stop()
    assert _actor_ids(routers["a"]) == ids
    _serves(routers["a"], reference)


def test_a_killed_router_process_leaves_the_workers_serving(routers, reference):
    """A router in a process of its own, SIGKILLed mid-stream: the workers abort
    its request (its streams broke) and go on serving the other router."""
    a = routers["a"]
    with router_process(NAME) as victim:
        assert victim.workers == _actor_ids(a)

        async def stream_then_kill() -> int:
            got = 0
            async with TandemClient(victim.address) as client:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    async for r in client.generate(TEXTS[1], temperature=0, max_tokens=400):
                        got += len(r.chunk.token_ids)
                        if got >= 3:
                            victim.kill()
            return got

        assert asyncio.run(stream_then_kill()) >= 3
        victim.process.wait(30)
    assert _actor_ids(a) == victim.workers
    _serves(a, reference)  # no leak: the killed router's request was aborted


def test_a_restarted_router_attaches_warm(routers, reference):
    """A router SIGKILLed after serving, then the last router stopped: a new
    router of the name attaches to the same worker processes, caches warm."""
    a = routers["a"]
    ids, processes = _actor_ids(a), worker_processes(a.backend)
    with router_process(NAME) as victim:
        outs = asyncio.run(_complete(victim.address, TEXTS))  # the prompts are cached now
        assert [o.token_ids for o in outs] == [reference[t] for t in TEXTS]
        victim.kill()
        victim.process.wait(30)
    routers.pop("a").stop()  # no router left
    routers["c"] = c = Deployment(CONFIG)  # same name, not attach: it attaches
    assert _actor_ids(c) == ids  # no worker started: the same actors,
    assert worker_processes(c.backend) == processes  # in the same processes, never restarted
    outs = _serves(c, reference)
    assert outs[1].usage.cached_tokens > 0  # the prefix cached before the restart


def test_a_killed_worker_is_replaced_by_default(routers, reference):
    c = routers["c"]
    assert c.config.pools.worker_check_interval_s > 0  # the default
    old = c.backend.decode.workers[0]
    ray.kill(old.actor, no_restart=True)
    assert _wait(
        lambda: [w.name for w in c.backend.decode.workers] not in ([], [old.name]),
    ), "no replacement"
    assert len(c.backend.decode.workers) == 1
    _serves(c, reference)
    # A second router sees the replacement, made once.
    routers["d"] = d = Deployment(CONFIG.updated(deployment={"attach": True}))
    assert _actor_ids(d) == _actor_ids(c)
    assert _workers_in_namespace() == {"deployment", *_actor_ids(c)}


def test_a_worker_dead_while_no_router_runs_is_replaced_at_the_next_start(routers, reference):
    """Every router gone, a worker dies: the next router starts anyway, reporting
    it to the owner and taking its replacement."""
    for key in list(routers):
        routers.pop(key).stop()
    ns = dep_mod.namespace_of(NAME)
    decode = [n for n in _workers_in_namespace() if n.startswith("decode-")]
    ray.kill(ray.get_actor(decode[0], namespace=ns), no_restart=True)
    routers["e"] = e = Deployment(CONFIG)
    assert [w.name for w in e.backend.decode.workers] not in ([], decode)
    _serves(e, reference)


def test_down_removes_the_workers_and_the_actor(routers):
    for key in list(routers):
        routers.pop(key).stop()
    assert len(_workers_in_namespace()) == 3  # the workers outlive their routers
    removed = dep_mod.down(NAME, drain_timeout_s=5)
    assert len(removed) == 2
    assert _wait(lambda: not _workers_in_namespace(), 60)
    assert not dep_mod.exists(NAME)
    with pytest.raises(dep_mod.DeploymentNotFound):
        dep_mod.down(NAME)
