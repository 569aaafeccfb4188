"""KV block transfer between workers: interface, pool adapter, the gRPC mover."""

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
