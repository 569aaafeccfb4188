"""The sending half of a transfer, whatever moves the bytes.

Its blocks come from a ``KVFeed`` (feed.py), which pins them as their KV
becomes ready and releases them on ``close``, exactly once, whether the
transfer succeeded, failed or was abandoned. The header names every block
from the start; a push whose receiver answers that it holds the first k
already (``skip``) sends chunks for the others only, numbered as in the
header. ``take`` gives the chunks ready since the last call, split to at
most ``chunk_bytes`` each, then the final that the commit carries.
"""

from __future__ import annotations

from collections.abc import Iterator

from protos.tandem.v1 import kv_transfer_pb2 as pb

from .feed import Final, KVFeed, Span
from .interface import PushHeader, TransferState, new_staging
from .wire import encode_chunk, encode_commit, encode_header, layout_to_proto, plan_chunks


class KVSender:
    def __init__(self, feed: KVFeed, header: PushHeader, chunk_bytes: int) -> None:
        self.feed = feed
        self.source = feed.source
        self.header_fields = header
        self.state = TransferState.TRANSFERRING
        self.chunk_bytes = chunk_bytes
        self.skipped = 0  # leading blocks the receiver holds: no chunk carries them
        self.bytes_sent = 0
        self._staging: memoryview | None = None

    @property
    def request_id(self) -> str:
        return self.header_fields.request_id

    def header(self) -> pb.TransferHeader:
        """The header: every block the feed will bring (taken once it started)."""
        h, layout = self.header_fields, self.source.layout
        n = self.feed.num_blocks
        hashes = list(h.block_hashes[:n]) if n else []
        return pb.TransferHeader(
            layout=layout_to_proto(layout),
            request_id=h.request_id,
            num_blocks=n,
            block_hashes=[b or b"" for b in hashes],
            token_ids=list(h.token_ids[: self.feed.num_tokens]) if n else [],
            total_bytes=n * layout.block_bytes,
            decode_start=h.decode_start,
            grant=h.grant,
            cache_salt=h.cache_salt,
        )

    def skip(self, held: int) -> None:
        """The receiver holds the first ``held`` blocks: send the others only
        (before the first chunk is taken). At least the last block is sent."""
        if not 0 <= held < max(self.feed.num_blocks, 1):
            raise ValueError(f"receiver holds {held} of {self.feed.num_blocks} blocks")
        self.skipped = held
        self.feed.skip(held)

    def take(self) -> tuple[list[Span], Final | None]:
        """The chunks ready since the last take, and the final after the last one."""
        spans, final = self.feed.take()
        per_layer = self.source.layout.block_bytes_per_layer
        chunks = []
        for ls, le, bs, be in spans:
            for cls_, cle, cbs, cbe in plan_chunks(le - ls, be - bs, per_layer, self.chunk_bytes):
                chunks.append((ls + cls_, ls + cle, bs + cbs, bs + cbe))
        return chunks, final

    def span_bytes(self, span: Span) -> int:
        ls, le, bs, be = span
        return (le - ls) * (be - bs) * self.source.layout.block_bytes_per_layer

    def block_ids(self, span: Span) -> list[int]:
        ids = self.feed.block_ids[span[2] : span[3]]
        assert None not in ids, "a span of unpinned blocks"
        return ids  # type: ignore[return-value]

    def views(self, span: Span) -> list[memoryview]:
        """A chunk's payload as views: of the pinned blocks themselves where the
        source offers them (``buffers``), else of a staging buffer that the
        next call reuses (use the views before asking for the next)."""
        ls, le, _, _ = span
        blocks = self.block_ids(span)
        buffers = getattr(self.source, "buffers", None)
        views = buffers(blocks, ls, le) if buffers is not None else None
        if views is None:
            size = self.span_bytes(span)
            if self._staging is None or self._staging.nbytes < size:
                self._staging = new_staging(self.source, size)
            self.source.read_into(blocks, ls, le, self._staging[:size], self.feed.computed)
            views = [self._staging[:size]]
        return views

    def chunk_message(self, span: Span) -> bytes:
        """A chunk as a message (the gRPC stream), gathered from the blocks."""
        ls, le, bs, be = span
        blocks = self.block_ids(span)

        def fill(out: memoryview) -> None:
            self.source.read_into(blocks, ls, le, out, self.feed.computed)

        size = self.span_bytes(span)
        msg = encode_chunk(span, self.header_fields.hashes_of(bs, be), size, fill)
        self.bytes_sent += size
        return msg

    def commit_message(self, final: Final) -> bytes:
        return encode_commit(final.next_token_ids, final.first_token)

    def messages(self) -> Iterator[bytes]:
        """The encoded header, then every chunk, gathered only when asked for
        (a feed ready from the start: a pull's)."""
        yield encode_header(self.header())
        spans, _ = self.take()
        for span in spans:
            yield self.chunk_message(span)

    def close(self, succeeded: bool = False) -> None:
        """Unpin the blocks; safe to call more than once."""
        if self.state is TransferState.TRANSFERRING:
            self.feed.close()
            self.state = TransferState.SUCCEEDED if succeeded else TransferState.FAILED
