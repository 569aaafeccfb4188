"""The receiving half of a transfer, whatever moves the bytes.

Header: check the layout and the blocks' hashes (chain.py: a push's are
recomputed from its tokens, a pull's must be those asked for); take the
leading blocks the pool already holds
(a push's receiver, ``reuse_prefix``: their chunks are not sent) and
reserve the rest, all held by a lease holder of this transfer's own.
Chunks: check range, hashes, size and checksum, then write into the
reserved blocks. Commit: check every (layer, block) arrived exactly once
and index the blocks; the holder keeps them for whoever takes them on. Any
error fails the transfer, which releases every block it holds exactly once.

``on_message_async`` overlaps the checksum and copy of one chunk (in a
worker thread; both release the GIL) with reading the next; blocks are
released only once that copy has finished. A push whose chunks come over a
data connection (datachannel.py, ``expect_data``) treats that connection's
thread the same way: it is the write in flight until it has ended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
import numpy as np

from engine.block_pool import Held, Holder
from protos.tandem.v1 import kv_transfer_pb2 as pb

from .chain import cache_salt_for, pulled_hashes, push_hashes
from .interface import BlockSink, NoRoom, TransferError, TransferState
from .lease import lease_holder
from .wire import Chunk, Commit, Malformed, Message, layout_from_proto

if TYPE_CHECKING:
    from .datachannel import IncomingData

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


class KVReceiver:
    def __init__(
        self,
        sink: BlockSink,
        reuse_prefix: bool = False,
        asked: Sequence[bytes] | None = None,
        asked_tokens: Sequence[int] = (),
    ) -> None:
        """``asked``: a pull's receiver, which takes only the leading blocks
        of these hashes (over ``asked_tokens``, when given); None: a push's,
        which recomputes the hashes from the header's tokens."""
        self.sink = sink
        self.reuse_prefix = reuse_prefix
        self.asked = asked
        self.asked_tokens = asked_tokens
        self.cache_salt = b""  # what the blocks are indexed under (chain.py)
        self.held_blocks = 0  # leading blocks the pool held already (no chunk brings them)
        self.decode_start = b""
        self.state = TransferState.PENDING
        self.request_id = ""
        self.holder: Holder | None = None  # of the reserved blocks, from the header on
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # as the chunks name them
        self._cached_hashes: list[bytes] = []  # as the prefix cache indexes them
        self.token_ids: list[int] = []
        self.next_token_ids: list[int] = []  # from the commit
        self.first_token = b""  # from the commit
        self.bytes_received = 0
        self._seen: np.ndarray | None = None  # [num_layers, num_blocks] chunks written
        self._block_layer_bytes = sink.layout.block_bytes_per_layer
        self._inflight: concurrent.futures.Future[None] | None = None
        self._data: IncomingData | None = None

    def on_message(self, msg: Message) -> bool:
        """Apply one message; True once a commit message has been applied."""
        try:
            if isinstance(msg, Malformed):
                raise TransferError(_INVALID, f"malformed message: {msg.reason}")
            if isinstance(msg, pb.TransferHeader):
                self.on_header(msg)
            elif isinstance(msg, Chunk):
                self.on_chunk(msg)
            elif isinstance(msg, Commit):
                self.commit(msg)
                return True
        except NoRoom:
            raise  # nothing held, still pending: the header may come again
        except TransferError as e:
            self.fail()
            raise e
        return False

    def on_header(self, header: pb.TransferHeader) -> None:
        if self.state is not TransferState.PENDING:
            raise TransferError(_INVALID, "second header in one transfer")
        theirs = layout_from_proto(header.layout)
        field = self.sink.layout.mismatch(theirs)
        if field is not None:
            raise TransferError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"KV layout mismatch in {field}: receiver has "
                f"{getattr(self.sink.layout, field)!r}, sender {getattr(theirs, field)!r}",
            )
        if (why := self.sink.layout.unmappable(theirs)) is not None:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout: {why}")
        n = header.num_blocks
        if len(header.block_hashes) not in (0, n):
            raise TransferError(_INVALID, f"{len(header.block_hashes)} block_hashes for {n} blocks")
        if len(header.token_ids) > n * self.sink.layout.block_size:
            raise TransferError(_INVALID, f"{len(header.token_ids)} token_ids for {n} blocks")
        if header.total_bytes and header.total_bytes != n * self.sink.layout.block_bytes:
            raise TransferError(_INVALID, f"total_bytes {header.total_bytes} does not fit layout")
        hashes = self._hashes(header)
        holder = lease_holder("recv", header.request_id)
        prefix: list[int] = []
        if self.reuse_prefix and n > 1:  # the last block always comes
            full = [h for h in hashes[: n - 1] if h]
            prefix = self.sink.hold_prefix(holder, full, header.token_ids)
        blocks = self.sink.reserve(holder, n - len(prefix))
        if blocks is None:
            self.sink.release(holder, prefix)
            raise NoRoom(n - len(prefix))
        self.holder, self.block_ids = holder, prefix + blocks
        self.held_blocks = len(prefix)
        self.request_id = header.request_id
        # As the header named them (equal to ``hashes`` where it did): chunks must name the same.
        self.block_hashes = list(header.block_hashes) or [b""] * n  # n blocks are reserved: sane
        self._cached_hashes = hashes
        self.cache_salt = cache_salt_for(self.sink.layout.wire_dtype, header.cache_salt)
        self.token_ids = list(header.token_ids)
        self.decode_start = header.decode_start
        self._seen = np.zeros((self.sink.layout.num_layers, n), dtype=bool)
        self._seen[:, : self.held_blocks] = True
        self.state = TransferState.TRANSFERRING

    def _hashes(self, header: pb.TransferHeader) -> list[bytes]:
        if self.asked is None:
            return push_hashes(header, self.sink.layout)
        return pulled_hashes(header, self.sink.layout, self.asked, self.asked_tokens)

    async def on_message_async(self, msg: Message, executor: concurrent.futures.Executor) -> bool:
        """``on_message`` with chunk writes in ``executor``, one at a time."""
        await self._drain()
        if not isinstance(msg, Chunk):
            return self.on_message(msg)
        try:
            self.check_chunk(msg)
        except TransferError:
            self.fail()
            raise
        self._inflight = executor.submit(self.write_chunk, msg)
        return False

    async def drain(self) -> None:
        """Wait for the chunk write in flight, if any (before a commit)."""
        await self._drain()

    async def _drain(self) -> None:
        inflight = self._inflight
        if inflight is None:
            return
        # Shielded: cancelling the wait must not cancel the write (which a
        # running future refuses anyway); fail() then defers the release.
        waiter = asyncio.wrap_future(inflight)
        waiter.add_done_callback(_retrieve)  # the outcome is read from ``inflight``
        await asyncio.wait([waiter])
        self._inflight = None
        try:
            inflight.result()
        except TransferError:
            self.fail()
            raise

    def on_chunk(self, chunk: Chunk) -> None:
        self.check_chunk(chunk)
        self.write_chunk(chunk)

    def check_chunk(self, chunk: Chunk) -> None:
        self.check_span(
            chunk.layer_start,
            chunk.layer_end,
            chunk.block_start,
            chunk.block_end,
            len(chunk.data),
            chunk.block_hashes,
        )

    def check_span(
        self,
        ls: int,
        le: int,
        bs: int,
        be: int,
        nbytes: int,
        block_hashes: tuple[bytes, ...] | None = None,
    ) -> None:
        """Check a chunk's place and size (and its hashes, if it names them)
        and mark it arrived; the payload is checked and written afterwards."""
        if self.state is not TransferState.TRANSFERRING or self._seen is None:
            raise TransferError(_INVALID, "chunk before header")
        if not (0 <= ls < le <= self._seen.shape[0] and 0 <= bs < be <= self._seen.shape[1]):
            raise TransferError(_INVALID, f"chunk range layers {ls}:{le} blocks {bs}:{be}")
        if self._seen[ls:le, bs:be].any():
            raise TransferError(_INVALID, f"chunk layers {ls}:{le} blocks {bs}:{be} sent twice")
        if block_hashes is not None and tuple(self.block_hashes[bs:be]) != block_hashes:
            raise TransferError(_INVALID, f"chunk blocks {bs}:{be} carry other hashes")
        expected = (le - ls) * (be - bs) * self._block_layer_bytes
        if nbytes != expected:
            raise TransferError(_INVALID, f"chunk has {nbytes} bytes, expected {expected}")
        self._seen[ls:le, bs:be] = True
        self.bytes_received += expected

    def sink_buffers(
        self, block_ids: Sequence[int], layer_start: int, layer_end: int
    ) -> list[memoryview] | None:
        """Writable views of the blocks in wire order, if the sink offers them."""
        buffers = getattr(self.sink, "buffers", None)
        return None if buffers is None else buffers(block_ids, layer_start, layer_end)

    def expect_data(self, incoming: IncomingData) -> None:
        """The chunks come over a data connection (datachannel.py): until it
        ends, it is this transfer's chunk write in flight."""
        if self._inflight is not None:
            raise TransferError(grpc.StatusCode.INTERNAL, "data connection with a write in flight")
        self._data = incoming
        self._inflight = incoming.done

    def write_chunk(self, chunk: Chunk) -> None:
        """Verify the checksum and copy into the blocks; thread-safe."""
        if chunk.crc32 is None or zlib.crc32(chunk.data) != chunk.crc32:
            raise TransferError(
                grpc.StatusCode.DATA_LOSS,
                f"checksum mismatch in layers {chunk.layer_start}:{chunk.layer_end} "
                f"blocks {chunk.block_start}:{chunk.block_end}",
            )
        self.sink.write(
            self.block_ids[chunk.block_start : chunk.block_end], chunk.layer_start, chunk.data
        )

    @property
    def held(self) -> Held:
        """The reserved blocks and their holder (after the header)."""
        assert self.holder is not None, "no header yet"
        return Held(self.holder, self.block_ids)

    def commit(self, message: Commit | None = None) -> Held:
        """Index the blocks; they are the caller's to release or hand over.
        ``message``: a push's commit, with the tokens sampled after the blocks'."""
        if self.state is not TransferState.TRANSFERRING or self._seen is None:
            raise TransferError(_INVALID, "commit before header")
        if self._inflight is not None:
            raise TransferError(grpc.StatusCode.INTERNAL, "commit with a chunk write in flight")
        if not self._seen.all():
            missing = int((~self._seen).sum())
            raise TransferError(_INVALID, f"commit with {missing} (layer, block) parts missing")
        self.sink.commit(self.block_ids, self._cached_hashes, self.token_ids)
        if message is not None:
            self.next_token_ids = list(message.next_token_ids)
            self.first_token = message.first_token
        self.state = TransferState.SUCCEEDED
        return self.held

    def fail(self) -> None:
        """Release every reserved block; safe to call more than once."""
        if self._data is not None:
            self._data.abort()  # sets the in-flight future now, or once its thread stopped
        if self.state is TransferState.TRANSFERRING:
            inflight = self._inflight
            if inflight is not None and not inflight.done():
                # A thread still copies into the blocks: release them after it.
                loop = asyncio.get_running_loop()
                held, release = self.held, self.sink.release
                inflight.add_done_callback(
                    lambda _: loop.call_soon_threadsafe(release, held.holder, held.block_ids)
                )
            else:
                self.sink.release(self.held.holder, self.block_ids)
        if self.state is not TransferState.SUCCEEDED:
            self.state = TransferState.FAILED


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
