from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "wire_dtype", "tensor_parallel_size")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    wire_dtype: str
    tensor_parallel_size: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., wire_dtype: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("layout", "request_id", "num_blocks", "block_hashes", "token_ids", "total_bytes", "decode_start", "grant", "cache_salt")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_START_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    request_id: str
    num_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    decode_start: bytes
    grant: bytes
    cache_salt: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., decode_start: _Optional[bytes] = ..., grant: _Optional[bytes] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer_start", "layer_end", "block_start", "block_end", "block_hashes", "crc32", "data")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    crc32: int
    data: bytes
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., block_end: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., crc32: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("next_token_ids", "first_token")
    NEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    next_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: bytes
    def __init__(self, next_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[bytes] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    chunk: KVChunk
    commit: Commit
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("request_id", "block_ids", "bytes_received")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    bytes_received: int
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("layout", "request_id", "block_hashes", "grant")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    grant: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., grant: _Optional[bytes] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    chunk: KVChunk
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ...) -> None: ...
