"""The KV transfer contract: what moves, the pool it moves between, and the
mover's interface.

A mover (gRPC, in-process, later shared memory or RDMA) only ever touches a
pool through ``BlockSource`` (the sending side) and ``BlockSink`` (the
receiving side), never the engine. Every block a transfer reserves, pins or
receives is held by a "lease" holder of its own (``lease.lease_holder``);
whoever ends up with a transfer's blocks gets them as a ``Held``: that
holder and the block ids. Every mover reports failures as a
``TransferError`` carrying a gRPC status code, so callers see one error type
whatever moved the bytes.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from engine.block_pool import Held, Holder
from engine.kv_layout import KVLayout
from net.security import ClusterSecurity

if TYPE_CHECKING:
    from .feed import KVFeed

# Room a chunk message needs beyond its payload (block hashes, span, checksum).
CHUNK_OVERHEAD_BYTES = 1 << 20


class TransferState(enum.Enum):
    PENDING = "pending"  # created, no header yet
    TRANSFERRING = "transferring"  # header accepted, blocks reserved or pinned
    SUCCEEDED = "succeeded"  # committed (receiver) or fully sent (sender)
    FAILED = "failed"  # every block reserved or pinned for it is released


class TransferError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self):
        # Pickled by Ray when a worker's call fails with it: rebuild from both fields.
        return (type(self), (self.code, self.message))


class NoRoom(TransferError):
    """A header's blocks do not fit now. The receiver holds nothing and stays
    pending: the same header may be applied again once blocks are freed."""

    def __init__(self, blocks: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room for {blocks} blocks")
        self.blocks = blocks

    def __reduce__(self):
        return (type(self), (self.blocks,))


NO_ROOM_WAIT = "no KV room within the push's wait"
"""The start of a push's status details when it waited for room past its
bound: a client rebuilds ``PushNoRoom`` from it (the code alone is not enough:
gRPC's own message-size limits answer RESOURCE_EXHAUSTED too)."""


class PushNoRoom(TransferError):
    """A push's blocks found no room on the decode worker within its wait
    (``lease_s``). Not a failed transfer: the pool was
    full; the router queues the request again (router/admission.py)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)


def transfer_error(code: grpc.StatusCode, details: str) -> TransferError:
    """The error a transfer call's status stands for."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(NO_ROOM_WAIT):
        return PushNoRoom(code, details)
    return TransferError(code, details)


@dataclass(frozen=True)
class TransferConfig:
    """Knobs shared by the servers and clients of every mover."""

    lease_s: float = 30.0
    """Blocks reserved for an incoming transfer, pinned for an outgoing pull,
    or committed but not yet claimed are released after this long without
    progress."""
    reap_interval_s: float = 0.25
    """How often a server looks for expired leases."""
    chunk_bytes: int = 8 << 20
    """Target payload size of one chunk message."""
    timeout_s: float = 60.0
    """Default deadline of one client pull, and the longest a push may go without
    progress (a streamed push lasts as long as its prefill)."""
    data_channel: bool = True
    """gRPC mover: carry a push's chunks over a raw TCP connection negotiated
    in the PushBlocks call (datachannel.py; several times the throughput of
    chunks in the gRPC stream). Header, layout check, commit and every error stay
    on the gRPC call. False on a server: it offers no data connection and
    clients fall back to the gRPC stream; on a client: it never asks."""
    tls_data_channel: bool = False
    """With cluster TLS, still offer the data connection (TLS by Python's ssl
    module). Off: under TLS, chunks go over the gRPC stream, which was as fast
    for bulk pushes and saves small pushes a TLS handshake per data
    connection (docs/benchmarks.md). Without TLS it has no effect."""
    stream_push: bool = True
    """A prefill worker opens its push as soon as the prompt's first step ran and
    sends each block's KV once computed, layer by layer, while the rest of the
    prompt is computed; the first token, sampled last, goes in the commit. False:
    the push starts once the prefill is done (TTFT then includes the whole
    transfer, and the decode worker holds the blocks only while they move)."""
    max_concurrent_pushes: int = 32
    """Pushes one client runs at once; more wait their turn before their call
    (and its deadline) starts, so that under a burst each push stays short
    instead of all of them crawling past their deadlines."""
    max_message_bytes: int = 64 << 20
    """Largest gRPC message a KV server or client sends or accepts, and the
    largest data-channel frame payload; must exceed ``chunk_bytes`` by
    ``CHUNK_OVERHEAD_BYTES``. Bigger messages fail with RESOURCE_EXHAUSTED."""
    security: ClusterSecurity = field(default_factory=ClusterSecurity.generate)
    """Cluster secret and TLS of the KV endpoints (security.py); the default is a
    fresh random secret, which only ends sharing this config can prove."""
    port_range: tuple[int, int] | None = None
    """Ports (both ends included) a worker's internal listeners bind: its KV
    gRPC server, its data channel and its output streams each take the first
    free one; None: ports the kernel picks."""
    local_streams: bool = True
    """A worker's output stream to a router on the same machine (same kernel
    and network namespace) goes over a Unix socket (local_socket.py): the
    engine thread's write each step costs about half of loopback TCP's. No
    TLS on it (it never leaves the machine); its handshake still proves the
    cluster secret. Off on a worker: it offers none; on a router: it never
    asks."""

    def __post_init__(self) -> None:
        if self.port_range is not None and not 0 < self.port_range[0] <= self.port_range[1]:
            raise ValueError(f"port_range {self.port_range}: expected (low, high), 0 < low <= high")
        if self.max_concurrent_pushes < 1:
            raise ValueError(
                f"max_concurrent_pushes must be >= 1, got {self.max_concurrent_pushes}"
            )
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.max_message_bytes < self.chunk_bytes + CHUNK_OVERHEAD_BYTES:
            raise ValueError(
                f"max_message_bytes {self.max_message_bytes} leaves no room for a chunk of "
                f"{self.chunk_bytes} bytes (+{CHUNK_OVERHEAD_BYTES} of metadata)"
            )


@dataclass(frozen=True)
class PushHeader:
    """What a push's header says: known before the KV of its blocks is
    computed (a prefill pushes while it computes; kv_transfer/feed.py)."""

    request_id: str
    token_ids: Sequence[int]  # the tokens whose KV the blocks hold
    block_hashes: Sequence[bytes | None] = ()  # one per block (None: a partial one), or none
    decode_start: bytes = b""  # what the receiving decode worker checks and starts with
    cache_salt: bytes = b""  # the request's prefix-cache domain (its blocks' hash ``extra``)
    grant: bytes = field(default=b"", repr=False)  # the router's push grant (net/grants.py)

    def hashes_of(self, start: int, end: int) -> list[bytes]:
        """The hashes of blocks [start, end) as the header names them (b"": none)."""
        named = self.block_hashes
        return [(named[i] if i < len(named) else None) or b"" for i in range(start, end)]


@dataclass(frozen=True)
class KVBlocks:
    """Blocks of one request on the sending side, all computed already."""

    request_id: str
    block_ids: Sequence[int]
    block_hashes: Sequence[bytes | None]  # one per block; None for a partial block
    token_ids: Sequence[int]  # the tokens whose KV the blocks hold
    next_token_ids: Sequence[int] = ()  # sampled after them, KV not computed (a prefill's)
    decode_start: bytes = b""  # what the receiving decode worker starts the request with
    cache_salt: bytes = b""  # the request's prefix-cache domain (its blocks' hash ``extra``)
    grant: bytes = field(default=b"", repr=False)  # the router's push grant (net/grants.py)
    first_token: bytes = b""  # the first token's details, for the commit (decode_start.py)

    def header(self) -> PushHeader:
        return PushHeader(
            self.request_id,
            self.token_ids,
            self.block_hashes,
            self.decode_start,
            self.cache_salt,
            self.grant,
        )


@dataclass(frozen=True)
class PushResult:
    request_id: str
    remote_block_ids: list[int]  # held for request_id on the receiver
    bytes_sent: int
    held_blocks: int = 0  # leading blocks the receiver already held: not sent


@dataclass(frozen=True)
class PullResult:
    block_ids: list[int]  # in the local sink, held by ``holder`` for the caller
    block_hashes: list[bytes]
    bytes_received: int
    holder: Holder

    @property
    def held(self) -> Held:
        return Held(self.holder, self.block_ids)


@dataclass(frozen=True)
class CommittedPush:
    """A push the receiver committed, handed to its ``PushHandler``."""

    request_id: str
    blocks: Held  # the transfer's holder and its blocks; the handler takes them on
    token_ids: list[int]  # the tokens whose KV the blocks hold
    next_token_ids: list[int]  # sampled after them (from the commit)
    decode_start: bytes  # from the header
    held_blocks: int  # leading blocks the receiver held before the push
    cache_salt: bytes = b""  # what its blocks are indexed under here (chain.py)
    first_token: bytes = b""  # from the commit (protocol/decode_start.py's FirstToken)


class PushHandler(Protocol):
    """Who takes a server's committed pushes (a decode worker). Without one,
    a committed push waits, leased, for ``claim``."""

    def check(self, request_id: str, decode_start: bytes) -> None:
        """Refuse a push (raise TransferError) before any block is reserved
        (its grant is checked already)."""

    def committed(self, push: CommittedPush) -> None:
        """Take over a committed push; called on the server's event loop once
        the push's call has ended."""


class BlockSink(Protocol):
    """The receiving side of a pool."""

    layout: KVLayout

    def reserve(self, holder: Holder, n: int) -> list[int] | None:
        """``n`` fresh blocks held by ``holder``, or None if too few are free."""

    def write(self, block_ids: Sequence[int], layer_start: int, data: memoryview) -> None:
        """Copy a chunk's payload (see kv_transfer.proto) into the blocks."""

    def commit(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes | None],
        token_ids: Sequence[int],
    ) -> None:
        """Index the full blocks in the prefix cache; their holder keeps them."""

    def release(self, holder: Holder, block_ids: Sequence[int] | None = None) -> None:
        """Drop ``holder``'s reference to each block (None: to all it holds)."""

    def hold_prefix(
        self, holder: Holder, block_hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> list[int]:
        """The longest run of leading blocks the pool holds already (hashes
        and tokens equal); ``holder`` takes a reference to each."""

    # Optional, for movers that write into the blocks without a staging copy:
    # def buffers(self, block_ids, layer_start, layer_end) -> list[memoryview] | None:
    #     """Writable views of the blocks laid out as a chunk's payload."""
    # Optional, where staging copies are best made from special memory:
    # def staging_buffer(self, nbytes) -> memoryview:
    #     """A host buffer for chunk payloads (page-locked for a GPU cache)."""


class BlockSource(Protocol):
    """The sending side of a pool."""

    layout: KVLayout

    def pin(self, holder: Holder, block_ids: Sequence[int]) -> None:
        """``holder`` takes a reference, so the blocks cannot be freed while being read."""

    def pin_hashes(
        self, holder: Holder, block_hashes: Sequence[bytes]
    ) -> tuple[list[int], list[int]]:
        """Pin the longest held prefix of ``block_hashes``: (block ids, token ids)."""

    def read_into(
        self,
        block_ids: Sequence[int],
        layer_start: int,
        layer_end: int,
        out: memoryview,
        computed: bool = False,
    ) -> None:
        """Gather a chunk's payload (see kv_transfer.proto) into ``out``.
        ``computed``: the blocks' KV is known to be in device memory already
        (a streamed push's reports: engine/layer_reports.py), so the copy need
        not wait for the work the engine queued since."""

    def release(self, holder: Holder, block_ids: Sequence[int] | None = None) -> None:
        """As ``BlockSink.release``: unpin."""

    # Optional, for movers that send from the blocks without a gather copy:
    # def buffers(self, block_ids, layer_start, layer_end) -> list[memoryview] | None:
    #     """Views of the blocks laid out as a chunk's payload (PoolBlockStore)."""
    # def staging_buffer(self, nbytes) -> memoryview: as for BlockSink.


class KVTransferClient(ABC):
    """Pushes blocks to, and pulls blocks from, a ``KVTransferServer``."""

    @abstractmethod
    async def stream(
        self,
        address: str,
        header: PushHeader,
        feed: KVFeed,
        *,
        timeout_s: float | None = None,
    ) -> PushResult:
        """The push: the header once ``feed`` started, each chunk once the feed
        has it, then the commit with the feed's final. ``timeout_s`` bounds the
        time without progress (the feed's or the bytes'). The feed is closed
        (its blocks released) when this returns or raises."""

    async def push(
        self, address: str, source: BlockSource, blocks: KVBlocks, *, timeout_s: float | None = None
    ) -> PushResult:
        """Push blocks whose KV is computed already: a feed ready at once."""
        from .feed import Final, KVFeed
        from .lease import lease_holder

        holder = lease_holder("send", blocks.request_id)
        final = Final(tuple(blocks.next_token_ids), blocks.first_token)
        feed = KVFeed.ready(source, threading.RLock(), holder, blocks.block_ids, final)
        return await self.stream(address, blocks.header(), feed, timeout_s=timeout_s)

    @abstractmethod
    async def pull(
        self,
        address: str,
        sink: BlockSink,
        block_hashes: Sequence[bytes],
        *,
        request_id: str = "",
        grant: bytes = b"",
        token_ids: Sequence[int] = (),
        timeout_s: float | None = None,
    ) -> PullResult:
        """Fetch the longest prefix of ``block_hashes`` the holder has, with
        the router's pull ``grant``; ``token_ids``: the blocks' tokens, which
        the holder's must equal (empty: not checked)."""

    async def close(self) -> None:
        return None


class KVTransferServer(ABC):
    """Receives pushes into, and serves pulls from, one worker's pool."""

    address: str

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving and release every block held for a transfer."""

    @abstractmethod
    def claim(self, request_id: str) -> Held | None:
        """Take the blocks a push committed for ``request_id``: their lease
        holder keeps them, no longer timed, until the caller releases them or
        hands them over. None if there is none (never came, expired)."""

    @abstractmethod
    def discard(self, request_id: str) -> None:
        """The request is gone: free what a push for it holds, committed or in
        flight, and refuse one that has not begun."""


def new_staging(store: BlockSink | BlockSource, nbytes: int) -> memoryview:
    """A staging buffer for chunk payloads: the store's own kind where it
    offers one (pinned memory for a GPU cache), else plain host memory."""
    make = getattr(store, "staging_buffer", None)
    return make(nbytes) if make is not None else memoryview(bytearray(nbytes))
