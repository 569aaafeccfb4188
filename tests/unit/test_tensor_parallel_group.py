"""The ranks' groups (engine/parallel/group.py, auth.py), built in one process
with a thread per rank: each pair of ranks proves the engine's secret before
anything else crosses a group, a rank that cannot is refused, the secret
never reaches the rendezvous store.
(tests/integration/test_tensor_parallel_engine.py runs ranks as processes.)"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.block_pool import Holder
from engine.kv_layout import KVLayout
from engine.parallel import auth, group
from engine.parallel.group import RankGroup, Rendezvous
from kv_transfer import TransferConfig
from net.security import ClusterSecurity

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

CPU = torch.device("cpu")
SECRET = auth.new_secret()
LAYOUT = KVLayout("fp-tp", "float32", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
SENDER = Holder("request", "sender")
CONFIG = TransferConfig(security=ClusterSecurity.generate(), lease_s=30)


def _build(rendezvous: Rendezvous, secrets: list[bytes]) -> list[RankGroup | Exception]:
    """Each rank's group, or what building it raised (a thread per rank)."""
    results: list[RankGroup | Exception | None] = [None] * len(secrets)

    def run(rank: int) -> None:
        try:
            results[rank] = RankGroup(rendezvous, rank, rendezvous.store(), CPU, secrets[rank])
        except Exception as exc:  # the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(secrets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def test_ranks_that_hold_the_secret_build_their_groups():
    """Three ranks: every pair proves itself, in an order that cannot deadlock."""
    rendezvous = Rendezvous.new(3, "gloo")
    try:
        groups = _build(rendezvous, [SECRET] * 3)
    finally:
        rendezvous.remove()
    assert all(isinstance(g, RankGroup) for g in groups), groups
    sums = [torch.full((2,), float(r + 1)) for r in range(3)]
    pairs = zip(groups, sums, strict=True)
    threads = [threading.Thread(target=g.all_reduce, args=(t,)) for g, t in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(t, torch.full((2,), 6.0)) for t in sums)


def test_a_rank_without_the_secret_is_refused_on_both_sides():
    """A stranger that took rank 1's place in a pair completes the connection
    but cannot answer the challenge: neither side starts, and each says why."""
    rendezvous = Rendezvous.new(2, "gloo")
    try:
        first, second = _build(rendezvous, [SECRET, auth.new_secret()])
    finally:
        rendezvous.remove()
    assert isinstance(first, auth.PeerRefused)
    assert "group 'steps': rank 1 gave a wrong answer" in str(first)
    assert "does not hold this engine's secret" in str(first)
    assert isinstance(second, auth.PeerRefused)
    assert "group 'steps': rank 0 gave a wrong answer" in str(second)


def test_the_secret_never_reaches_the_rendezvous_directory():
    rendezvous = Rendezvous.new(2, "gloo")
    try:
        groups = _build(rendezvous, [SECRET, SECRET])
        assert all(isinstance(g, RankGroup) for g in groups), groups
        stored = _directory_bytes(rendezvous.directory)
    finally:
        rendezvous.remove()
    assert stored  # the store was written (its keys, the ranks' addresses)
    assert SECRET not in stored and SECRET.hex().encode() not in stored
    assert auth.answer(SECRET, "steps", 1, 0, b"") not in stored


def _directory_bytes(directory: str) -> bytes:
    out = b""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out += f.read()
    return out


@pytest.mark.parametrize("wrong", [None, 2])
def test_the_gathered_proof_refuses_any_rank_without_the_secret(wrong):
    """The NCCL group's proof (two all-gathers), run here over gloo."""
    rendezvous = Rendezvous.new(3, "gloo")
    results: list[Exception | None] = [None] * 3

    def run(rank: int) -> None:
        pg = group._gloo(rendezvous.store(), rank, 3)
        secret = auth.new_secret() if rank == wrong else SECRET
        try:
            auth.gathered(pg, "model", rank, 3, secret, CPU)
        except auth.PeerRefused as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        rendezvous.remove()
    if wrong is None:
        assert results == [None] * 3
    else:  # every rank sees it
        assert "rank 2 gave a wrong answer" in str(results[0])
        assert "rank 2 gave a wrong answer" in str(results[1])
        assert "rank 0 gave a wrong answer" in str(results[2])
