"""The sending half of a transfer, whatever moves the bytes.

Takes blocks already pinned in the source by the transfer's lease holder
and yields the encoded header and chunks; ``close`` releases them exactly
once, whether the transfer succeeded, failed or was abandoned. The header
names every block; a push whose receiver answers that it holds the first k
already (``skip``) sends chunks for the others only, numbered as in the
header.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.block_pool import Holder
from protos.tandem.v1 import kv_transfer_pb2 as pb

from .interface import BlockSource, KVBlocks, TransferState, new_staging
from .lease import lease_holder
from .wire import encode_chunk, encode_header, layout_to_proto, plan_chunks


class KVSender:
    def __init__(
        self,
        source: BlockSource,
        holder: Holder,
        request_id: str,
        pinned_block_ids: Sequence[int],
        block_hashes: Sequence[bytes | None],
        token_ids: Sequence[int],
        chunk_bytes: int,
        next_token_ids: Sequence[int] = (),
        decode_start: bytes = b"",
        cache_salt: bytes = b"",
        grant: bytes = b"",
    ) -> None:
        if len(block_hashes) != len(pinned_block_ids):
            raise ValueError(f"{len(block_hashes)} hashes for {len(pinned_block_ids)} blocks")
        self.source = source
        self.holder = holder  # pins ``block_ids``
        self.state = TransferState.TRANSFERRING
        self.request_id = request_id
        self.block_ids = list(pinned_block_ids)
        self.block_hashes = [h or b"" for h in block_hashes]
        self.token_ids = list(token_ids)
        self.next_token_ids = list(next_token_ids)
        self.decode_start = decode_start
        self.cache_salt = cache_salt
        self.grant = grant
        self.chunk_bytes = chunk_bytes
        self.skipped = 0  # leading blocks the receiver holds: no chunk carries them
        self.bytes_sent = 0

    @classmethod
    def push(cls, source: BlockSource, blocks: KVBlocks, chunk_bytes: int) -> KVSender:
        """The sender of a push: its own lease holder pins ``blocks`` (once
        the sender, which releases them, exists)."""
        sender = cls(
            source,
            lease_holder("send", blocks.request_id),
            blocks.request_id,
            blocks.block_ids,
            blocks.block_hashes,
            blocks.token_ids,
            chunk_bytes,
            blocks.next_token_ids,
            blocks.decode_start,
            blocks.cache_salt,
            blocks.grant,
        )
        source.pin(sender.holder, blocks.block_ids)
        return sender

    @property
    def total_bytes(self) -> int:
        return len(self.block_ids) * self.source.layout.block_bytes

    def header(self) -> pb.TransferHeader:
        return pb.TransferHeader(
            layout=layout_to_proto(self.source.layout),
            request_id=self.request_id,
            num_blocks=len(self.block_ids),
            block_hashes=self.block_hashes,
            token_ids=self.token_ids,
            next_token_ids=self.next_token_ids,
            total_bytes=self.total_bytes,
            decode_start=self.decode_start,
            grant=self.grant,
            cache_salt=self.cache_salt,
        )

    def skip(self, held: int) -> None:
        """The receiver holds the first ``held`` blocks: send the others only
        (before the first chunk is asked for). At least the last block is sent."""
        if not 0 <= held < max(len(self.block_ids), 1):
            raise ValueError(f"receiver holds {held} of {len(self.block_ids)} blocks")
        self.skipped = held

    def spans(self) -> list[tuple[int, int, int, int]]:
        layout = self.source.layout
        k = self.skipped
        spans = plan_chunks(
            layout.num_layers,
            len(self.block_ids) - k,
            layout.block_bytes_per_layer,
            self.chunk_bytes,
        )
        return [(ls, le, bs + k, be + k) for ls, le, bs, be in spans]

    def chunks(self) -> Iterator[tuple[tuple[int, int, int, int], list[memoryview]]]:
        """Each chunk's span and payload as views, in wire order.

        Views of the pinned blocks themselves where the source offers them
        (``buffers``), else of a staging buffer that the next chunk reuses:
        use the views before asking for the next chunk.
        """
        layout = self.source.layout
        buffers = getattr(self.source, "buffers", None)
        staging: memoryview | None = None
        for span in self.spans():
            ls, le, bs, be = span
            blocks = self.block_ids[bs:be]
            views = buffers(blocks, ls, le) if buffers is not None else None
            if views is None:
                size = (le - ls) * len(blocks) * layout.block_bytes_per_layer
                if staging is None or staging.nbytes < size:
                    staging = new_staging(self.source, size)
                self.source.read_into(blocks, ls, le, staging[:size])
                views = [staging[:size]]
            yield span, views

    def messages(self) -> Iterator[bytes]:
        """The encoded header, then each chunk, gathered only when asked for."""
        layout = self.source.layout
        yield encode_header(self.header())
        for span in self.spans():
            ls, le, bs, be = span
            blocks = self.block_ids[bs:be]
            size = (le - ls) * len(blocks) * layout.block_bytes_per_layer

            def fill(out: memoryview, blocks: list[int] = blocks, ls: int = ls, le: int = le):
                self.source.read_into(blocks, ls, le, out)

            yield encode_chunk(span, self.block_hashes[bs:be], size, fill)
            self.bytes_sent += size

    def close(self, succeeded: bool = False) -> None:
        """Unpin the blocks; safe to call more than once."""
        if self.state is TransferState.TRANSFERRING:
            self.source.release(self.holder, self.block_ids)
            self.state = TransferState.SUCCEEDED if succeeded else TransferState.FAILED
