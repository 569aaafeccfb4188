"""Wire encoding of transfer messages, with no copy of the tensor bytes.

A chunk is a ``KVChunk`` protobuf whose ``data`` field is written last, so
the sender gathers blocks from the pool straight into the outgoing message
and the receiver takes the payload as a view of the incoming one. The bytes
are ordinary protobuf: a client built from the generated stubs can decode
them. Only the small metadata goes through the protobuf library.

Copies of the payload: sender pool -> message (the gather) -> gRPC; gRPC ->
message -> receiver pool (the scatter). The checksum reads the message.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from google.protobuf.message import DecodeError

from engine.kv_cache import KVLayout
from protos.tandem.v1 import kv_transfer_pb2 as pb

# Field numbers shared by PushRequest and PullResponse.
HEADER_FIELD, CHUNK_FIELD, COMMIT_FIELD = 1, 2, 3
_DATA_FIELD = 15
_LEN = 2  # wire type of length-delimited fields


@dataclass(frozen=True)
class Chunk:
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    block_hashes: tuple[bytes, ...]
    crc32: int | None
    data: memoryview


@dataclass(frozen=True)
class Commit:
    """A push's last message: the tokens sampled after the blocks' tokens and
    the first token's details (protocol/decode_start.py); both empty in a push
    that only moves blocks."""

    next_token_ids: tuple[int, ...] = ()
    first_token: bytes = b""


@dataclass(frozen=True)
class Malformed:
    reason: str


Message = pb.TransferHeader | Chunk | Commit | Malformed


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        wire_dtype=layout.wire_dtype,
        tensor_parallel_size=layout.tp_size,
    )


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(
        model_fingerprint=msg.model_fingerprint,
        dtype=msg.dtype,
        num_layers=msg.num_layers,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        wire_dtype=msg.wire_dtype,
        tp_size=msg.tensor_parallel_size or 1,
    )


def tensor_view(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over ``buf`` without a copy; valid while ``buf`` lives.

    torch has no read-only tensors and warns on a read-only buffer (received
    messages are bytes), so one is viewed through its address; such views
    are only ever read.
    """
    if buf.readonly:
        address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        buf = memoryview((ctypes.c_char * buf.nbytes).from_address(address)).cast("B")
    return torch.frombuffer(buf, dtype=dtype)


def plan_chunks(
    num_layers: int, num_blocks: int, block_layer_bytes: int, target_bytes: int
) -> list[tuple[int, int, int, int]]:
    """(layer_start, layer_end, block_start, block_end) of each chunk, layer-major."""
    layer_bytes = num_blocks * block_layer_bytes
    if num_blocks == 0:
        return []
    if layer_bytes <= target_bytes:
        step = max(1, target_bytes // layer_bytes)
        return [
            (lo, min(lo + step, num_layers), 0, num_blocks) for lo in range(0, num_layers, step)
        ]
    step = max(1, target_bytes // block_layer_bytes)
    return [
        (layer, layer + 1, lo, min(lo + step, num_blocks))
        for layer in range(num_layers)
        for lo in range(0, num_blocks, step)
    ]


def encode_header(header: pb.TransferHeader) -> bytes:
    return pb.PushRequest(header=header).SerializeToString()


def encode_commit(next_token_ids: Sequence[int] = (), first_token: bytes = b"") -> bytes:
    commit = pb.Commit(next_token_ids=next_token_ids, first_token=first_token)
    return pb.PushRequest(commit=commit).SerializeToString()


def encode_chunk(
    span: tuple[int, int, int, int],
    block_hashes: Sequence[bytes],
    payload_bytes: int,
    fill: Callable[[memoryview], None],
) -> bytes:
    """A PushRequest/PullResponse holding a chunk whose payload ``fill`` writes."""
    layer_start, layer_end, block_start, block_end = span
    meta = pb.KVChunk(
        layer_start=layer_start,
        layer_end=layer_end,
        block_start=block_start,
        block_end=block_end,
        block_hashes=block_hashes,
        crc32=0,  # fixed32 with presence: same length whatever the value
    )
    meta_bytes = meta.SerializeToString()
    data_key = _varint((_DATA_FIELD << 3) | _LEN) + _varint(payload_bytes)
    inner = len(meta_bytes) + len(data_key) + payload_bytes
    outer = _varint((CHUNK_FIELD << 3) | _LEN) + _varint(inner)
    msg, view = _new_bytes(len(outer) + inner)
    meta_at = len(outer)
    payload_at = meta_at + len(meta_bytes) + len(data_key)
    view[:meta_at] = outer
    view[meta_at + len(meta_bytes) : payload_at] = data_key
    payload = view[payload_at:]
    fill(payload)
    meta.crc32 = zlib.crc32(payload)
    view[meta_at : meta_at + len(meta_bytes)] = meta.SerializeToString()
    return msg


def decode(data: bytes) -> Message:
    """Decode a PushRequest or PullResponse; a chunk's payload stays a view."""
    try:
        fields = _fields(memoryview(data))
        if len(fields) != 1:
            return Malformed(f"expected one message field, got {len(fields)}")
        number, body = fields[0]
        if number == HEADER_FIELD:
            return pb.TransferHeader.FromString(bytes(body))
        if number == COMMIT_FIELD:
            commit = pb.Commit.FromString(bytes(body))
            return Commit(tuple(commit.next_token_ids), commit.first_token)
        if number == CHUNK_FIELD:
            return _decode_chunk(body)
        return Malformed(f"unknown field {number}")
    except (ValueError, IndexError, RuntimeError, DecodeError) as e:
        # DecodeError is not a ValueError with protobuf's upb backend (bad UTF-8 in a
        # string field of a truncated header raised out of the deserializer: INTERNAL).
        return Malformed(str(e))


def decode_pull_request(data: bytes) -> pb.PullRequest | Malformed:
    """A PullRequest, or Malformed (a request that does not parse is refused
    with INVALID_ARGUMENT, not an error escaping the deserializer)."""
    try:
        return pb.PullRequest.FromString(data)
    except (ValueError, RuntimeError, DecodeError) as e:
        return Malformed(str(e))


def _decode_chunk(body: memoryview) -> Chunk | Malformed:
    data: memoryview | None = None
    meta = pb.KVChunk()
    pos = 0
    while pos < len(body):
        start = pos
        key, pos = _read_varint(body, pos)
        number, wire_type = key >> 3, key & 7
        if number == _DATA_FIELD and wire_type == _LEN:
            size, pos = _read_varint(body, pos)
            data, pos = body[pos : pos + size], pos + size
            continue
        pos = _skip(body, pos, wire_type)
        meta.MergeFromString(bytes(body[start:pos]))
    if pos != len(body) or data is None:
        return Malformed("chunk without data")
    return Chunk(
        layer_start=meta.layer_start,
        layer_end=meta.layer_end,
        block_start=meta.block_start,
        block_end=meta.block_end,
        block_hashes=tuple(meta.block_hashes),
        crc32=meta.crc32 if meta.HasField("crc32") else None,
        data=data,
    )


def _fields(buf: memoryview) -> list[tuple[int, memoryview]]:
    out = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        if key & 7 != _LEN:
            raise ValueError(f"field {key >> 3}: unexpected wire type {key & 7}")
        size, pos = _read_varint(buf, pos)
        if pos + size > len(buf):
            raise ValueError("truncated message")
        out.append((key >> 3, buf[pos : pos + size]))
        pos += size
    return out


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    if wire_type == _LEN:
        size, pos = _read_varint(buf, pos)
        return pos + size
    raise ValueError(f"unsupported wire type {wire_type}")


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_bytes_from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_from_size.restype = ctypes.py_object
_bytes_from_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _new_bytes(size: int) -> tuple[bytes, memoryview]:
    """A new, uninitialised bytes object and a writable view of its buffer.

    gRPC sends only ``bytes``; building the message in place saves a copy of
    every payload. This is the C API's own pattern (PyBytes_FromStringAndSize
    with NULL, then fill): the object is not shared until it is returned.
    """
    msg = _bytes_from_size(None, size)
    address = ctypes.cast(ctypes.c_char_p(msg), ctypes.c_void_p).value
    return msg, memoryview((ctypes.c_char * size).from_address(address)).cast("B")
