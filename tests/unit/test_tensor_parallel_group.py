"""The ranks' groups (engine/parallel/group.py, auth.py), built in one process
with a thread per rank: each pair of ranks proves the engine's secret before
anything else crosses a group, a rank that cannot is refused, the secret
never reaches the rendezvous store; and rank 0's KV reads and writes give up
on a rank that stops answering, releasing every block a transfer held.
(tests/integration/test_tensor_parallel_engine.py runs ranks as processes.)"""

from __future__ import annotations

import asyncio
import datetime
import os
import threading
from collections.abc import Iterator

import pytest
import torch

from engine.block_pool import BlockPool, Holder
from engine.kv_cache import KVCache
from engine.kv_layout import KVLayout
from engine.parallel import auth, group
from engine.parallel.group import GroupBroken, RankGroup, Rendezvous
from engine.parallel.kv import ShardedKV
from kv_transfer import GrpcKVClient, GrpcKVServer, KVBlocks, PoolBlockStore, TransferConfig
from kv_transfer.interface import TransferError
from kv_transfer.sharded_store import ShardedBlockStore
from net.security import ClusterSecurity
from tests.kv_grants import push_grant
from tests.kv_harness import LoopThread, block_tokens
from tests.pool_checks import leftover_holders

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


# ---- a rank that stops answering ---------------------------------------------


@pytest.fixture
def hung(monkeypatch) -> Iterator[RankGroup]:
    """Rank 0's group of two, whose rank 1 joined and then answers nothing
    (it keeps its connections open, as a hung process does)."""
    monkeypatch.setattr(group, "KV_TIMEOUT", datetime.timedelta(seconds=1))
    rendezvous = Rendezvous.new(2, "gloo")
    try:
        zero, one = _build(rendezvous, [SECRET, SECRET])
    finally:
        rendezvous.remove()
    assert isinstance(zero, RankGroup) and isinstance(one, RankGroup)
    yield zero
    del one


def _sharded_store(rank0: RankGroup) -> ShardedBlockStore:
    tp_layout = KVLayout(**{**LAYOUT.__dict__, "tp_size": 2})
    cache = KVCache(tp_layout, 16, CPU)
    return ShardedBlockStore(BlockPool(16, LAYOUT.block_size), cache, ShardedKV(rank0, cache))


def _plain_store() -> PoolBlockStore:
    return PoolBlockStore(BlockPool(16, LAYOUT.block_size), KVCache(LAYOUT, 16, CPU))


def test_a_read_waiting_on_a_hung_rank_fails_and_breaks_the_group(hung):
    kv = ShardedKV(hung, KVCache(KVLayout(**{**LAYOUT.__dict__, "tp_size": 2}), 4, CPU))
    with pytest.raises(GroupBroken, match=r"collective failed: .*[Tt]imed out"):
        kv.read([0, 1], 0, 2)
    with pytest.raises(GroupBroken, match="is broken"):  # no later pass or transfer waits
        kv.write([0], 0, torch.zeros(2, 2, 1, 4, 2, 8))
    assert not kv._lock.locked()


def _push(src: PoolBlockStore, dst: PoolBlockStore, n: int) -> tuple[Exception, list, int]:
    """Push ``n`` of ``src``'s blocks to a server over ``dst``; what the push
    raised, and the server's holders and free blocks once it settled."""
    thread = LoopThread()
    server = GrpcKVServer(dst, CONFIG)
    thread.run(server.start())
    initial_free = dst.num_free
    ids = src.reserve(SENDER, n)
    tokens = block_tokens(n, 1)
    blocks = KVBlocks("r", ids, [None] * n, tokens, grant=push_grant(CONFIG, server.address, "r"))

    async def go() -> Exception:
        client = GrpcKVClient(CONFIG)
        try:
            await client.push(server.address, src, blocks)
        except Exception as exc:  # returned to the test
            return exc
        finally:
            await client.close()
        raise AssertionError("the push went through")

    try:
        raised = thread.run(go())
        held = thread.run(_settled(dst, initial_free))
    finally:
        thread.run(server.stop(0))
        thread.close()
    assert leftover_holders(src.pool) == [SENDER]  # the push's own pin is gone
    src.release(SENDER)
    return raised, held, initial_free


async def _settled(store: PoolBlockStore, free: int) -> list:
    for _ in range(500):
        if store.holders() == [] and store.num_free == free:
            break
        await asyncio.sleep(0.02)
    store.pool.verify()
    return store.holders()


def test_a_push_from_a_worker_whose_rank_hangs_fails_and_frees_every_block(hung):
    src = _sharded_store(hung)
    dst = _plain_store()
    raised, held, _ = _push(src, dst, 3)
    assert isinstance(raised, GroupBroken)
    assert held == [] and dst.num_free == 16
    assert leftover_holders(src.pool) == [] and src.num_free == 16


def test_a_push_into_a_worker_whose_rank_hangs_fails_and_frees_every_block(hung):
    dst = _sharded_store(hung)
    src = _plain_store()
    raised, held, _ = _push(src, dst, 3)
    assert isinstance(raised, TransferError)
    assert held == [] and dst.num_free == 16
    assert hung.broken is not None and "imed out" in hung.broken
