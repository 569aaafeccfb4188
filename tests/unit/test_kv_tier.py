"""The second KV tier behind an engine's pool (engine/kv_tier.py): a pool
holding 1/8 of a multi-turn workload's prefixes plus the tier hits as a
pool 8x larger, with the same outputs; a full tier, corrupted or stale
entries and a restart serve nothing wrong; every run leaves the pool and
the tier as it found them."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from benchkit.kv_tier_workload import Workload, play
from engine import EngineConfig, LLMEngine
from engine.kv_tier import mapped_file
from tests.pool_checks import leftover_holders

pytestmark = pytest.mark.unit

WORKLOAD = Workload(conversations=8, output_tokens=4)  # 8 chats x 3 turns, ~40 prefix blocks
BIG, SMALL = 64, 8  # blocks: the big pool holds every prefix, the small 1/8 of it


def _engine(llama_dir, tmp_path, num_blocks: int, tier_blocks: int | None = None, **kw):
    config = EngineConfig(
        model=str(llama_dir), num_kv_blocks=num_blocks, kv_tier_num_blocks=tier_blocks,
        kv_tier_dir=str(tmp_path / "tier"), **kw,
    )  # fmt: skip
    return LLMEngine(config)


def _check_clean(engine: LLMEngine) -> None:
    assert leftover_holders(engine.block_pool) == []
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


@pytest.fixture(scope="module")
def reference(llama_dir, tmp_path_factory):
    """The workload on the big pool, no tier: every returning prefix hits."""
    engine = _engine(llama_dir, tmp_path_factory.mktemp("ref"), BIG)
    played = play(engine, WORKLOAD)
    assert engine.block_pool.num_cached < BIG  # nothing was evicted
    _check_clean(engine)
    return played


@pytest.mark.slow  # plays the whole workload, and the reference once
def test_small_pool_with_tier_hits_like_a_pool_8x_larger(llama_dir, tmp_path, reference):
    alone = play(_engine(llama_dir, tmp_path, SMALL), WORKLOAD)
    assert alone.cached_tokens() < reference.cached_tokens() // 2  # the small pool forgets

    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=BIG)
    played = play(engine, WORKLOAD)
    assert played.cached() == reference.cached()
    assert played.outputs() == reference.outputs()
    assert alone.outputs() == reference.outputs()
    stats = engine.kv_tier.stats
    assert stats.hits > 0 and stats.rejected == 0 and stats.evicted == 0
    assert stats.bytes_out == stats.hits * engine.kv_layout.block_bytes
    assert stats.bytes_in == stats.spilled * engine.kv_layout.block_bytes
    _check_clean(engine)


@pytest.mark.slow  # plays the whole workload, and the reference once
def test_a_full_tier_evicts_and_serves_nothing_wrong(llama_dir, tmp_path, reference):
    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=16)
    played = play(engine, WORKLOAD)
    assert played.outputs() == reference.outputs()
    stats = engine.kv_tier.stats
    assert stats.evicted > 0 and stats.hits > 0
    assert len(engine.kv_tier) == stats.blocks <= 16
    for key, cached in played.cached().items():
        assert cached <= reference.cached()[key]
    _check_clean(engine)


@pytest.mark.slow  # plays the whole workload, and the reference once
def test_corrupted_entries_are_misses(llama_dir, tmp_path, reference):
    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=BIG)
    tier = engine.kv_tier
    real_spill = tier.spill

    def spill_then_corrupt(block, block_hash, tokens):  # every entry's bytes go bad
        real_spill(block, block_hash, tokens)
        tier.storage[tier._entries[block_hash].slot, :8] ^= 0x5A

    tier.spill = spill_then_corrupt
    played = play(engine, WORKLOAD)
    assert played.outputs() == reference.outputs()
    assert tier.stats.hits == 0 and tier.stats.rejected > 0
    _check_clean(engine)


def test_an_entry_with_other_tokens_is_a_miss(llama_dir, tmp_path):
    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=BIG)
    play(engine, Workload(conversations=4, turns=1))
    pool, tier = engine.block_pool, engine.kv_tier
    pool.allocate(holder := _holder(), pool.num_blocks)  # evicts (spills) every cached block
    pool.release(holder)
    some_hash = tier.hashes()[0]
    tokens = list(tier._entries[some_hash].tokens)
    assert pool.block_for_hash(some_hash) is None
    assert pool.match_prefix(holder, [some_hash], [[t + 1 for t in tokens]]) == []
    assert pool.match_prefix(holder, [some_hash], [tokens]) != []
    pool.release(holder)
    _check_clean(engine)


def test_cache_events_say_which_tier_holds_a_block(llama_dir, tmp_path):
    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=4)
    pool = engine.block_pool
    play(engine, Workload(conversations=1, turns=1))  # 2 full blocks cached
    device = pool.drain_delta().device
    assert len(device) == 2
    pool.allocate(holder := _holder(), pool.num_blocks)
    delta = pool.drain_delta()
    assert sorted(delta.host) == sorted(device) and delta.removed == [] == delta.device
    assert sorted(pool.cached_hashes()) == sorted(device) == sorted(pool.host_hashes())
    pool.release(holder)
    play(engine, Workload(conversations=3, turns=1, seed=7))  # 6 more blocks: 4 fit the tier
    pool.allocate(holder, pool.num_blocks)
    delta = pool.drain_delta()
    assert set(delta.removed) >= set(device)  # the oldest entries went
    assert len(pool.host_hashes()) == 4
    pool.release(holder)
    _check_clean(engine)


def test_a_restarted_worker_starts_with_an_empty_tier_and_no_file(llama_dir, tmp_path):
    first = _engine(llama_dir, tmp_path, SMALL, tier_blocks=BIG)
    play(first, Workload(conversations=4, turns=2))
    assert len(first.kv_tier) > 0
    assert list((tmp_path / "tier").iterdir()) == []  # unlinked once mapped
    first.close()
    assert first.block_pool.tier is None
    again = _engine(llama_dir, tmp_path, SMALL, tier_blocks=BIG)
    assert len(again.kv_tier) == 0 and again.block_pool.host_hashes() == []
    assert list((tmp_path / "tier").iterdir()) == []
    _check_clean(first)
    _check_clean(again)


def test_the_tier_file_is_private(tmp_path, monkeypatch):
    seen: list[int] = []
    real_unlink = os.unlink

    def unlink(name, *, dir_fd=None):
        seen.append(os.stat(name, dir_fd=dir_fd).st_mode & 0o777)
        real_unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", unlink)
    t = mapped_file(tmp_path / "d", 1 << 20)
    t[-1] = 7
    assert seen == [0o600] and int(t[-1]) == 7
    assert os.stat(tmp_path / "d").st_mode & 0o777 == 0o700
    assert list((tmp_path / "d").iterdir()) == []


def test_the_tier_file_is_mapped_through_its_descriptor(tmp_path, monkeypatch):
    def no_reopen(*args, **kwargs):
        raise AssertionError("the tier file was reopened by path")

    monkeypatch.setattr(torch, "from_file", no_reopen)
    t = mapped_file(tmp_path / "d", 1 << 16)
    t[:] = 3
    assert int(t.sum()) == 3 << 16


def test_the_whole_tier_is_reserved_on_disk_at_start(tmp_path, monkeypatch):
    reserved: list[int] = []

    def fallocate(fd, offset, length):
        reserved.append(length)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(OSError, match="cannot reserve 1048576 bytes for the KV tier"):
        mapped_file(tmp_path / "d", 1 << 20)
    assert reserved == [1 << 20]
    assert list((tmp_path / "d").iterdir()) == []  # nothing left behind


def test_a_shared_tier_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="writable by group or others"):
        mapped_file(shared, 1 << 16)
    assert list(shared.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory away")
def test_a_tier_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        mapped_file(theirs, 1 << 16)


def test_a_tier_directory_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        mapped_file(tmp_path / "link", 1 << 16)


def test_no_tier_without_prefix_caching(llama_dir, tmp_path):
    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=8, enable_prefix_caching=False)
    assert engine.kv_tier is None and engine.block_pool.tier is None


def test_tier_size_from_bytes(llama_dir, tmp_path):
    config = EngineConfig(model=str(llama_dir), num_kv_blocks=SMALL, kv_tier_memory_bytes=1 << 20,
                          kv_tier_dir=str(tmp_path))  # fmt: skip
    engine = LLMEngine(config)
    assert engine.kv_tier.capacity == (1 << 20) // engine.kv_layout.block_bytes


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_tier_behind_a_gpu_pool(llama_dir, tmp_path, reference):
    engine = _engine(llama_dir, tmp_path, SMALL, tier_blocks=BIG, device="cuda")
    assert engine.kv_tier.medium == "pinned" and engine.kv_tier.storage.is_pinned()
    played = play(engine, WORKLOAD)
    assert played.cached() == reference.cached()
    big = play(_engine(llama_dir, tmp_path, BIG, device="cuda"), WORKLOAD)
    assert played.outputs() == big.outputs()
    assert engine.kv_tier.stats.hits > 0
    _check_clean(engine)


def _holder():
    from engine.block_pool import Holder

    return Holder("scratch", "test-fill")
