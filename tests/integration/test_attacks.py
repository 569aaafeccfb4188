"""Attacks on a deployment started with default options (one prefill and
one decode worker, no cluster secret or TLS configured; one user key and
one admin key in the environment, an HTTP front). Each attack runs in a
process of its own with no credential (benchkit/attacker.py, driven by
benchkit/attacks.py) and must be refused with a precise status, or be
contained; meanwhile honest users stream greedy requests that must finish
with exactly the tokens of the engine alone, and every worker ends with
its blocks back.

The workers run tests/faults.py's Faulty*Actor classes, so that a prompt
starting with NAN_PROMPT (NAN_LATE_PROMPT) gets NaN logits at prefill
(after two decode tokens): no public request produces NaN otherwise
(docs/failures.md). Nothing else in them differs from the product's. The
insider attacks hand the attacker the generated cluster secret on stdin.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from benchkit.attack_outcome import Outcome
from benchkit.attack_target import cluster_secret, engine_alone, rss_mb, target_of, worker_pids
from benchkit.attacks import (
    ATTACKS,
    FORGE,
    FORGED_PROMPT,
    HONEST_PROMPTS,
    HONEST_SAMPLING,
    INSIDER,
    INSIDER_RESERVE,
    INSIDER_TAKEOVER,
    NAN_ATTACKS,
    RESERVE,
    STOP_FLOODS,
    TAKEOVER,
    reserve_pool,
    run_attacker,
    table,
)
from benchkit.deployment import Deployment
from benchkit.honest_load import HonestLoad
from router.client import TandemClient
from router.config import ServeConfig
from tests.faults import FaultyDecodeActor, FaultyPrefillActor

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

USER_KEY = "sk-attacks-user"
ADMIN_KEY = "sk-attacks-admin"
STOP_FLOOD_RSS_MB = 100.0
"""How much a worker's resident memory may grow over the stop-string floods."""
LEASES_S = 90.0
"""Time enough for every transfer lease (30 s by default) to run out."""


@pytest.fixture(scope="module")
def reference():
    return engine_alone()


@pytest.fixture(scope="module")
def dep(ray_cluster):
    env = pytest.MonkeyPatch()
    env.setenv("TANDEM_API_KEYS", USER_KEY)
    env.setenv("TANDEM_ADMIN_KEYS", ADMIN_KEY)
    try:
        deployment = Deployment(
            ServeConfig(engine={"kv_cache_memory_mb": 32}, server={"http_port": 0}),
            actor_classes={"prefill": FaultyPrefillActor, "decode": FaultyDecodeActor},
        )
    except BaseException:
        env.undo()
        raise
    yield deployment
    try:
        assert deployment.wait_no_leaks(LEASES_S) == {}
    finally:
        deployment.stop()
        env.undo()


@pytest.fixture(scope="module")
def target(dep, reference):
    return target_of(dep, USER_KEY, reference)


@pytest.fixture(scope="module")
def findings(target):
    rows: list = []
    yield rows
    print("\n" + table(rows))


@pytest.fixture(scope="module")
def honest(dep, reference):
    """Honest users' greedy streams, from the first attack to the last check."""
    load = HonestLoad(dep.address, USER_KEY, {p: reference.outputs[p] for p in HONEST_PROMPTS})
    load.start()
    deadline = time.monotonic() + 300
    while load.streams + len(load.errors) < len(HONEST_PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.2)  # one round served: the system prompt's blocks are cached
    yield load
    load.stop()


def _complete(dep: Deployment, prompt: str, timeout_s: float = 120) -> list[int] | str:
    """An honest request's tokens, or the status it failed with."""

    async def run():
        async with TandemClient(dep.address, timeout_s=timeout_s, api_key=USER_KEY) as client:
            return (await client.complete(prompt, **HONEST_SAMPLING)).token_ids

    try:
        return asyncio.run(run())
    except grpc.aio.AioRpcError as e:
        return e.code().name


def _with(outcome: Outcome, more: str) -> Outcome:
    return Outcome(outcome.status, f"{outcome.detail}; {more}")


def _said(answer: list[int] | str, want: list[int]) -> str:
    """An honest request's answer, in words: its own tokens, others, or a status."""
    if answer == want:
        return "its own tokens"
    return "other tokens" if isinstance(answer, list) else answer


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_the_attack_is_refused(attack, target, honest, findings):
    got = run_attacker(attack.args(target))
    findings.append((attack.name, got, attack.expected))
    assert got.status in attack.expected, got


def test_forged_kv_is_refused_and_never_served(dep, target, honest, reference, findings):
    got = run_attacker(FORGE.args(target))
    served_at_once = _complete(dep, FORGED_PROMPT)
    honest.pause()
    try:  # once the forged push's lease is over, its blocks would be in the cache
        leaks = dep.wait_no_leaks(LEASES_S)
        served_later = _complete(dep, FORGED_PROMPT)
    finally:
        honest.resume()
    want = reference.outputs[FORGED_PROMPT]
    said = f"{_said(served_at_once, want)}, after the leases {_said(served_later, want)}"
    findings.append((FORGE.name, _with(got, f"an honest user of it got {said}"), FORGE.expected))
    assert (served_at_once, served_later, leaks) == (want, want, {})
    assert got.status in FORGE.expected, got


def test_a_header_only_push_cannot_hold_the_pool(dep, target, honest, reference, findings):
    decode = target.of_role("decode", "colocated")[0].name
    honest.pause()
    try:
        assert dep.wait_no_leaks(LEASES_S) == {}
        free = dep.worker_stats()[decode].free_blocks

        def while_held():
            return dep.worker_stats()[decode].free_blocks, _complete(dep, HONEST_PROMPTS[2], 30)

        first, seen = reserve_pool(target, free, hold_s=15, while_held=while_held)
        leaks = dep.wait_no_leaks(LEASES_S)
    finally:
        honest.resume()
    if seen is not None:
        said = _said(seen[1], reference.outputs[HONEST_PROMPTS[2]])
        first = _with(first, f"while held: {seen[0]} blocks free, an honest request got {said}")
    findings.append((RESERVE.name, first, RESERVE.expected))
    assert leaks == {}
    assert first.status in RESERVE.expected, (first, seen)


def test_an_insider_without_a_grant_moves_no_kv(dep, target, honest, findings):
    """The cluster secret lets a process call a worker, not move KV: its
    pulls, its forged push and its header-only push are refused for want of
    the router's grant, and no block is held, not even for a moment."""
    secret = cluster_secret(dep)
    got = {a.name: run_attacker(a.args(target), secret=secret) for a in INSIDER}
    decode = target.of_role("decode", "colocated")[0].name
    honest.pause()
    try:
        assert dep.wait_no_leaks(LEASES_S) == {}
        free = dep.worker_stats()[decode].free_blocks
        reserve, seen = reserve_pool(
            target, free, 5, lambda: dep.worker_stats()[decode].free_blocks, secret
        )
        free_after = dep.worker_stats()[decode].free_blocks
        leaks = dep.wait_no_leaks(LEASES_S)
    finally:
        honest.resume()
    got[INSIDER_RESERVE.name] = _with(reserve, f"{free_after} of {free} blocks free after it")
    for attack in [*INSIDER, INSIDER_RESERVE]:
        findings.append((attack.name, got[attack.name], attack.expected))
    assert (seen, free_after, leaks) == (None, free, {})
    assert {name: o.status for name, o in got.items()} == {
        a.name: "PERMISSION_DENIED" for a in [*INSIDER, INSIDER_RESERVE]
    }, got


@pytest.mark.parametrize("attack", NAN_ATTACKS, ids=["at_prefill", "in_decode"])
def test_a_nan_request_fails_alone(dep, target, honest, findings, attack):
    """NaN logits on every try: INTERNAL once two tries faulted (docs/failures.md),
    after the tokens streamed before the fault; the workers stay in routing,
    the honest streams go on (checked last) and no block is left held."""
    got = run_attacker(attack.args(target))
    findings.append((attack.name, got, attack.expected))
    streamed = 2 if "--late" in attack.args(target) else 0
    assert got.status == "INTERNAL", got
    assert got.detail.startswith(f"{streamed} tokens streamed"), got
    assert "failed in 2 tries" in got.detail and "non-finite logits" in got.detail, got
    assert 'File "' not in got.detail and "pid=" not in got.detail, got  # no remote traceback
    backend = dep.backend
    assert (len(backend.prefill.workers), len(backend.decode.workers)) == target.pools
    honest.pause()
    try:
        assert dep.wait_no_leaks(LEASES_S) == {}
    finally:
        honest.resume()


def test_a_stop_string_flood_is_refused_with_bounded_memory(dep, target, honest, findings):
    pids = worker_pids(dep)
    before = {name: rss_mb(pid) for name, pid in pids.items()}
    got = [run_attacker(flood.args(target)) for flood in STOP_FLOODS]
    growth = {name: rss_mb(pid) - before[name] for name, pid in pids.items()}
    grown = ", ".join(f"{name} {mb:+.0f} MiB" for name, mb in growth.items())
    for flood, outcome in zip(STOP_FLOODS, got, strict=True):
        findings.append((flood.name, _with(outcome, f"worker RSS {grown}"), flood.expected))
    assert max(growth.values()) < STOP_FLOOD_RSS_MB, growth
    wrong = {f.name: o for f, o in zip(STOP_FLOODS, got, strict=True) if o.status not in f.expected}
    assert wrong == {}


@pytest.mark.parametrize("insider", [False, True], ids=["stranger", "insider"])
def test_the_routers_id_cannot_take_over_its_stream(
    dep, target, honest, reference, findings, insider
):
    """A stranger fails the handshake; an insider passes it, but the id's
    stream is live, so the worker closes the new one."""
    attack = INSIDER_TAKEOVER if insider else TAKEOVER
    got = run_attacker(attack.args(target), secret=cluster_secret(dep) if insider else None)
    after = _complete(dep, HONEST_PROMPTS[0])  # the router's stream still carries its tokens
    said = _said(after, reference.outputs[HONEST_PROMPTS[0]])
    findings.append(
        (attack.name, _with(got, f"the router's next request got {said}"), attack.expected)
    )
    assert after == reference.outputs[HONEST_PROMPTS[0]]
    assert got.status in attack.expected, got


def test_honest_streams_got_their_exact_tokens_throughout(dep, honest):
    """Last in the module: every honest stream served while the attacks ran."""
    honest.pause()
    assert honest.streams > len(HONEST_PROMPTS)
    assert (honest.mismatches, honest.errors) == ([], [])
    assert dep.wait_no_leaks(LEASES_S) == {}
    honest.resume()
