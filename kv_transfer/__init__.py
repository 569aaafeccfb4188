"""KV block transfer between workers: interface, pool adapter, movers."""

from .grpc_client import GrpcKVClient
from .grpc_server import GrpcKVServer
from .inproc import InProcHub, InProcKVClient, InProcKVServer
from .interface import (
    BlockSink,
    BlockSource,
    KVBlocks,
    KVTransferClient,
    KVTransferServer,
    PullResult,
    PushResult,
    TransferConfig,
    TransferError,
    TransferState,
)
from .pool_store import PoolBlockStore

__all__ = [
    "BlockSink",
    "BlockSource",
    "GrpcKVClient",
    "GrpcKVServer",
    "InProcHub",
    "InProcKVClient",
    "InProcKVServer",
    "KVBlocks",
    "KVTransferClient",
    "KVTransferServer",
    "PoolBlockStore",
    "PullResult",
    "PushResult",
    "TransferConfig",
    "TransferError",
    "TransferState",
]
