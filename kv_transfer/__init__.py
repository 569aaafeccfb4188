"""KV block transfer between workers: interface, pool adapter, movers."""

from .grpc_client import GrpcKVClient
from .grpc_server import GrpcKVServer
from .inproc import InProcHub, InProcKVClient, InProcKVServer
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
    "InProcHub",
    "InProcKVClient",
    "InProcKVServer",
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
