"""KV block transfer between workers: interface, pool adapter, the gRPC mover.

The names below load on first use: the router imports the torch-free ones
(``TransferConfig``, ``TransferError`` from kv_transfer/interface.py)
without loading the movers, which need torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .grpc_client import GrpcKVClient
    from .grpc_server import GrpcKVServer
    from .interface import (
        BlockSink,
        BlockSource,
        CommittedPush,
        KVBlocks,
        KVTransferClient,
        KVTransferServer,
        PullResult,
        PushHandler,
        PushResult,
        TransferConfig,
        TransferError,
        TransferState,
    )
    from .pool_store import PoolBlockStore

_WHERE = {
    "GrpcKVClient": "grpc_client",
    "GrpcKVServer": "grpc_server",
    "PoolBlockStore": "pool_store",
    **{
        name: "interface"
        for name in (
            "BlockSink",
            "BlockSource",
            "CommittedPush",
            "KVBlocks",
            "KVTransferClient",
            "KVTransferServer",
            "PullResult",
            "PushHandler",
            "PushResult",
            "TransferConfig",
            "TransferError",
            "TransferState",
        )
    },
}

__all__ = [
    "BlockSink",
    "BlockSource",
    "CommittedPush",
    "GrpcKVClient",
    "GrpcKVServer",
    "KVBlocks",
    "KVTransferClient",
    "KVTransferServer",
    "PoolBlockStore",
    "PullResult",
    "PushHandler",
    "PushResult",
    "TransferConfig",
    "TransferError",
    "TransferState",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
