"""Grants for tests that drive KV transfers without a router: minted as the
router mints them (net/grants.py), under the transfer config's secret."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kv_transfer.interface import KVBlocks, TransferConfig
from net.grants import PULL, PUSH, GrantMinter, pull_digest, push_digest


def push_grant(config: TransferConfig, address: str, request_id: str, salt: bytes = b"") -> bytes:
    return GrantMinter(config.security).mint(PUSH, address, request_id, push_digest(salt))


def pull_grant(
    config: TransferConfig, address: str, request_id: str, hashes: Sequence[bytes]
) -> bytes:
    return GrantMinter(config.security).mint(PULL, address, request_id, pull_digest(hashes))


def granted(config: TransferConfig, address: str, blocks: KVBlocks) -> KVBlocks:
    """``blocks`` with the router's grant to push them to ``address``."""
    grant = push_grant(config, address, blocks.request_id, blocks.cache_salt)
    return dataclasses.replace(blocks, grant=grant)
