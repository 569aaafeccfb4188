"""What a received transfer's blocks are indexed under: recomputed from the
tokens (with the request's cache salt), never the sender's hashes; and no
transfer without the router's grant. Every test leaves both pools as found."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
import torch

from engine.block_pool import BlockPool, Holder
from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import KVBlocks, PoolBlockStore, TransferConfig, TransferError
from net.security import ClusterSecurity
from tests.kv_grants import granted, pull_grant, push_grant
from tests.kv_inproc import InProcHub, InProcKVClient, InProcKVServer
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

LAYOUT = KVLayout("fp", "float32", 2, 4, 1, 8)
BS = LAYOUT.block_size
ROOT = root_hash(LAYOUT.model_fingerprint, BS)
CONFIG = TransferConfig(chunk_bytes=1024, security=ClusterSecurity(b"s" * 32))
SENDER = Holder("request", "r")
TOKENS = list(range(100, 100 + 3 * BS))


def _store(seed: int) -> PoolBlockStore:
    cache = KVCache(LAYOUT, 16, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for t in cache.layers:
        t.copy_(torch.randn(t.shape, generator=gen))
    return PoolBlockStore(BlockPool(16, BS), cache)


class Pair:
    def __init__(self) -> None:
        self.src, self.dst = _store(1), _store(2)
        self.hub = InProcHub()
        self.server = InProcKVServer(self.hub, "d", self.dst, CONFIG)
        self.client = InProcKVClient(self.hub, CONFIG)
        self.free = (self.src.num_free, self.dst.num_free)

    def blocks(self, tokens=TOKENS, hashes=None, salt: bytes = b"") -> KVBlocks:
        n = -(-len(tokens) // BS)
        ids = self.src.reserve(SENDER, n)
        blocks = KVBlocks("r", ids, hashes or [None] * n, tokens, cache_salt=salt)
        return granted(CONFIG, self.server.address, blocks)

    async def push(self, blocks: KVBlocks):
        await self.server.start()
        try:
            return await self.client.push(self.server.address, self.src, blocks)
        finally:
            held = self.server.claim("r")
            if held is not None:
                self.dst.release(held.holder)
            self.src.release(SENDER)
            await self.server.stop()

    def settled(self) -> bool:
        clean = leftover_holders(self.src.pool) == leftover_holders(self.dst.pool) == []
        return clean and (self.src.num_free, self.dst.num_free) == self.free


def _refused(pair: Pair, blocks: KVBlocks) -> TransferError:
    with pytest.raises(TransferError) as err:
        asyncio.run(pair.push(blocks))
    assert pair.settled()
    assert pair.dst.pool.cached_hashes() == []
    return err.value


def test_committed_blocks_get_the_hashes_of_their_tokens_and_salt():
    pair = Pair()
    asyncio.run(pair.push(pair.blocks(salt=b"tenant")))
    assert sorted(pair.dst.pool.cached_hashes()) == sorted(hash_blocks(TOKENS, BS, ROOT, b"tenant"))
    assert pair.settled()


def test_a_header_with_forged_hashes_is_refused_and_caches_nothing():
    pair = Pair()
    forged = hash_blocks(list(range(900, 900 + 3 * BS)), BS, ROOT)  # a popular prefix's
    err = _refused(pair, pair.blocks(hashes=forged))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes" in err.message


def test_hashes_of_another_salt_are_forged_hashes():
    pair = Pair()
    other = hash_blocks(TOKENS, BS, ROOT, b"tenant-a")
    err = _refused(pair, pair.blocks(hashes=other, salt=b"tenant-b"))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("n_tokens", [0, 2 * BS, 1])
def test_tokens_that_do_not_cover_the_blocks_are_refused(n_tokens):
    pair = Pair()
    blocks = pair.blocks()  # 3 blocks
    err = _refused(pair, dataclasses.replace(blocks, token_ids=TOKENS[:n_tokens]))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.message


# Grants for another push, by name, made when the test runs: the names are
# stable test ids (xdist workers must collect the same ones), and no grant
# ages between collection and use.
NOT_THIS_PUSHS_GRANT = {
    "empty": lambda: b"",
    "another-worker": lambda: push_grant(CONFIG, "inproc:other", "r"),
    "another-request": lambda: push_grant(CONFIG, "inproc:d", "r2"),
    "another-salt": lambda: push_grant(CONFIG, "inproc:d", "r", salt=b"another"),
    "another-secret": lambda: push_grant(TransferConfig(), "inproc:d", "r"),  # a random one
}


@pytest.mark.parametrize("grant", NOT_THIS_PUSHS_GRANT)
def test_a_push_without_its_grant_is_refused_before_any_block_is_reserved(grant):
    pair = Pair()
    err = _refused(pair, dataclasses.replace(pair.blocks(), grant=NOT_THIS_PUSHS_GRANT[grant]()))
    assert err.code == grpc.StatusCode.PERMISSION_DENIED


def _cached_keeper() -> tuple[InProcHub, InProcKVServer, PoolBlockStore, list[bytes]]:
    keeper = _store(3)
    hashes = hash_blocks(TOKENS, BS, ROOT)
    ids = keeper.reserve(SENDER, 3)
    keeper.commit(ids, hashes, TOKENS)
    keeper.release(SENDER)
    hub = InProcHub()
    return hub, InProcKVServer(hub, "k", keeper, CONFIG), keeper, hashes


def test_a_pull_needs_a_grant_for_exactly_its_hashes():
    async def go():
        hub, server, keeper, hashes = _cached_keeper()
        puller = _store(4)
        free = puller.num_free
        await server.start()
        client = InProcKVClient(hub, CONFIG)
        codes = []
        for grant in (
            b"",
            pull_grant(CONFIG, server.address, "p", hashes[:2]),  # fewer than asked
            pull_grant(CONFIG, "inproc:other", "p", hashes),
        ):
            with pytest.raises(TransferError) as err:
                await client.pull(server.address, puller, hashes, request_id="p", grant=grant)
            codes.append(err.value.code)
        grant = pull_grant(CONFIG, server.address, "p", hashes)
        pulled = await client.pull(
            server.address, puller, hashes, request_id="p", grant=grant, token_ids=TOKENS
        )
        with pytest.raises(TransferError) as replay:
            await client.pull(server.address, puller, hashes, request_id="p", grant=grant)
        await server.stop()
        assert codes == [grpc.StatusCode.PERMISSION_DENIED] * 3
        assert replay.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert pulled.block_hashes == hashes
        puller.release(pulled.holder)
        assert leftover_holders(keeper.pool) == leftover_holders(puller.pool) == []
        assert puller.num_free == free

    asyncio.run(go())


def test_a_puller_refuses_blocks_whose_tokens_are_not_the_ones_it_expects():
    async def go():
        hub, server, keeper, hashes = _cached_keeper()
        puller = _store(4)
        free = puller.num_free
        await server.start()
        client = InProcKVClient(hub, CONFIG)
        grant = pull_grant(CONFIG, server.address, "p", hashes)
        with pytest.raises(TransferError) as err:
            await client.pull(
                server.address, puller, hashes, request_id="p", grant=grant,
                token_ids=[t + 1 for t in TOKENS],
            )  # fmt: skip
        await server.stop()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert puller.pool.cached_hashes() == [] and puller.num_free == free
        assert leftover_holders(keeper.pool) == leftover_holders(puller.pool) == []

    asyncio.run(go())
