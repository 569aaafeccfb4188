"""The wire format of a worker's output stream: one TCP connection per
(router, worker), TLS first when the cluster has TLS. Decode workers send
each step's deltas and cache events on it, prefill workers their cache
events only.

    worker <-> router  the handshake of net/handshake.py: the worker sends
                       a nonce, the router answers with the tag
                       ``HANDSHAKE_TAG``, its router id as the identity and
                       the HMAC that proves the cluster secret
    worker -> router   frames  u32 length, then that many bytes of a serialized
                       StepBatch (worker.proto); one frame per engine step.
                       The first frame, a batch with only ``events_seq``,
                       opens the stream.

Integers are little-endian. An answer that does not prove the secret is
answered by closing the connection (the router sees the stream end before
it opened). The router never writes after its answer; either side closing
the connection ends the stream.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from protocol.outputs import RequestOutput
from protos.tandem.v1 import generate_pb2, worker_pb2

HANDSHAKE_TAG = b"tandem-output-stream"
LENGTH = struct.Struct("<I")


class ProtocolError(Exception):
    """The peer broke the output stream's protocol."""


def open_frame(events_seq: int, room: worker_pb2.KVRoom | None = None) -> bytes:
    """The frame that opens a stream: the count of cache-event batches the
    worker had published before it (the router saw none of those), and the
    worker's KV room when it reports one (a decode worker)."""
    payload = worker_pb2.StepBatch(events_seq=events_seq, room=room).SerializeToString()
    return LENGTH.pack(len(payload)) + payload


def to_delta(out: RequestOutput) -> worker_pb2.RequestDelta:
    delta = worker_pb2.RequestDelta(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text=out.text_delta,
        finished=out.finished,
        finish_reason=out.finish_reason or "",
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
        error=out.error or "",
    )
    for lp in out.logprobs or []:
        delta.logprobs.append(
            generate_pb2.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_logprobs=[generate_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
            )
        )
    return delta


def frames(batch: worker_pb2.StepBatch, max_bytes: int) -> Iterator[bytes]:
    """``batch`` as frames of at most ``max_bytes`` payload each (split between
    deltas and cache events when it is bigger: they are independent). The
    batch's ``events_seq`` goes on the last frame: a router that reads it
    has read every event of the batch; its ``room`` too."""
    payload = batch.SerializeToString()
    if len(payload) <= max_bytes or len(batch.deltas) + len(batch.cache_events) <= 1:
        yield LENGTH.pack(len(payload)) + payload
        return
    items = [*batch.deltas, *batch.cache_events]
    half = len(items) // 2
    room = batch.room if batch.HasField("room") else None
    for part, seq, last in ((items[:half], 0, False), (items[half:], batch.events_seq, True)):
        yield from frames(
            worker_pb2.StepBatch(
                deltas=[i for i in part if isinstance(i, worker_pb2.RequestDelta)],
                cache_events=[i for i in part if isinstance(i, worker_pb2.CacheEvent)],
                events_seq=seq,
                room=room if last else None,
            ),
            max_bytes,
        )


class FrameReader:
    """Splits a byte stream into frame payloads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads ``data`` completes; ProtocolError on an oversized frame."""
        buf = self._buffer
        buf += data
        out = []
        start = 0
        while len(buf) - start >= LENGTH.size:
            (size,) = LENGTH.unpack_from(buf, start)
            if size > self.max_bytes:
                raise ProtocolError(f"frame of {size} bytes; the limit is {self.max_bytes}")
            end = start + LENGTH.size + size
            if len(buf) < end:
                break
            out.append(bytes(buf[start + LENGTH.size : end]))
            start = end
        del buf[:start]
        return out
