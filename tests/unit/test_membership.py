"""The membership logic of a deployment's owner (router/membership.py) and
what a router attaching must agree with (router/deployment.py)."""

from __future__ import annotations

import pytest

from router.config import ServeConfig
from router.deployment import adopted, differences
from router.membership import Membership, new_worker_name, role_of

pytestmark = pytest.mark.unit


def test_names_are_unique_and_carry_their_role():
    names = {new_worker_name("decode") for _ in range(1000)}
    assert len(names) == 1000
    assert {role_of(n) for n in names} == {"decode"}
    assert role_of("deployment") is None and role_of("decode-0") is None
    with pytest.raises(ValueError, match="no worker role"):
        new_worker_name("router")


def test_every_change_moves_the_generation_and_only_a_change():
    m = Membership()
    seen = [m.generation]
    a, b = new_worker_name("prefill"), new_worker_name("decode")
    m.add([a, b])
    seen.append(m.generation)
    m.add([])
    assert m.generation == seen[-1]
    assert m.remove(["decode-000000000000"]) == [] and m.generation == seen[-1]
    assert m.remove([b]) == [b]
    seen.append(m.generation)
    assert len(set(seen)) == 3
    assert m.names() == [a]


def test_a_lost_worker_is_owed_one_replacement_however_often_reported():
    m = Membership()
    d0, d1 = new_worker_name("decode"), new_worker_name("decode")
    m.add([d0, d1])
    assert [x.name for x in m.lose([d0])] == [d0]
    assert m.lose([d0]) == []  # a second router reports it: nothing more owed
    assert m.owed() == {"decode": 1}
    m.replaced("decode", 1)
    assert m.owed() == {}
    m.lose([d1])
    m.resize("decode")  # an explicit size settles what was owed
    assert m.owed() == {}


def test_rebuilt_from_names_keeps_workers_and_never_repeats_a_generation():
    m = Membership()
    names = [new_worker_name("prefill"), new_worker_name("colocated")]
    m.add(names)
    again = Membership.from_names([*names, "deployment", "something-else"])
    assert sorted(again.names()) == sorted(names)
    assert again.names("colocated") == [names[1]]
    assert again.generation != m.generation


def test_an_attaching_router_must_agree_on_what_it_sets_and_takes_the_rest():
    deployed = ServeConfig(engine={"kv_cache_memory_mb": 32, "block_size": 32})
    assert differences(deployed, ServeConfig()) == []
    assert differences(deployed, ServeConfig(engine={"block_size": 32})) == []
    (diff,) = differences(deployed, ServeConfig(engine={"block_size": 16}))
    assert diff == "engine.block_size is 16, the deployment's 32"
    joined = adopted(deployed, ServeConfig(server={"port": 0}))
    assert joined.engine == deployed.engine and joined.server.port == 0


def test_config_deployment_section():
    assert ServeConfig().deployment.redis_name() == "default"
    assert ServeConfig(deployment={"name": "blue"}).deployment.redis_name() == "blue"
    with pytest.raises(ValueError, match="attach needs a deployment name"):
        ServeConfig(deployment={"attach": True})
    with pytest.raises(ValueError, match=r"deployment is now deployment\.name"):
        ServeConfig(routing={"deployment": "blue"})


def test_an_attaching_router_takes_the_deployments_secret_or_must_match_it():
    config = ServeConfig()
    config.security.adopt_secret(b"s" * 32)
    assert config.security.cluster_security().secret == b"s" * 32
    mine = ServeConfig(security={"cluster_secret": "other"})
    with pytest.raises(ValueError, match="differs from the secret of the deployment"):
        mine.security.adopt_secret(b"s" * 32)


def test_a_worker_a_restarted_owner_could_not_take_over_is_owed():
    m = Membership()
    m.owe("decode")
    assert m.owed() == {"decode": 1}


def test_the_owner_is_created_without_the_routers_keys():
    from router.deployment import for_owner

    config = ServeConfig(
        engine={"block_size": 32},
        security={"api_keys": ["user-key-1"], "admin_keys": ["admin-key-1"]},
        deployment={"name": "t"},
    )
    owned = for_owner(config)
    assert owned.security.api_keys == [] and owned.security.admin_keys == []
    assert owned.engine == config.engine and owned.deployment == config.deployment
    assert "user-key-1" not in repr(owned.model_dump())


def test_an_owner_without_workers_takes_the_config_of_the_next_start():
    """A first start that failed (a bad model) must not hold the name: an owner
    with no member and nothing owed takes the next router's config; one with
    workers refuses another model."""
    import asyncio
    import secrets

    from router.deployment import DeploymentOwner

    def config(block_size: int) -> ServeConfig:
        return ServeConfig(engine={"block_size": block_size}, deployment={"name": "t"})

    owner = DeploymentOwner("t", config(32), secrets.token_bytes(32))
    owner._adopted = True  # no Ray here: nothing to adopt
    joined = asyncio.run(owner.join(config(16)))
    assert not joined.refused and joined.config.engine.block_size == 16
    assert owner.config.engine.block_size == owner.controller.config.engine.block_size == 16
    owner.controller.membership.add(["decode-000000000001"])
    assert "engine.block_size" in asyncio.run(owner.join(config(32))).refused


def test_a_restarted_owner_adopts_the_workers_that_answer(monkeypatch):
    """PoolController.adopt: a worker found by name that answers its info is a
    member in the snapshot routers get (``Members``); one that does not is
    killed, and its role owed a replacement; other names are ignored."""
    import asyncio
    from types import SimpleNamespace

    from protocol.workers import WorkerInfo
    from router import pool_controller
    from router.pool_controller import PoolController

    live, dead = new_worker_name("decode"), new_worker_name("prefill")

    async def info(name):
        if name == dead:
            raise ConnectionError("actor died")
        return WorkerInfo(name, 64, 100, "fp", "inc", "/m")

    actors = {
        n: SimpleNamespace(info=SimpleNamespace(remote=lambda n=n: info(n))) for n in (live, dead)
    }
    killed = []
    monkeypatch.setattr(pool_controller.ray, "get_actor", lambda name, namespace: actors[name])
    monkeypatch.setattr(pool_controller.ray, "kill", lambda a, no_restart: killed.append(a))
    controller = PoolController(ServeConfig(), namespace="ns")
    members = asyncio.run(controller.adopt([live, dead, "deployment"]))
    assert [(w.name, w.role, w.actor) for w in members.workers] == [(live, "decode", actors[live])]
    assert members.generation == controller.generation() and not members.draining
    assert killed == [actors[dead]] and controller.membership.owed() == {"prefill": 1}
    assert controller.membership.names() == [live]
