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
from .security import ClusterSecurity, TLSFiles

__all__ = [
    "BlockSink",
    "BlockSource",
    "ClusterSecurity",
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
    "TLSFiles",
    "TransferConfig",
    "TransferError",
    "TransferState",
]
