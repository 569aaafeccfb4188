from protos.tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepBatch(_message.Message):
    __slots__ = ("deltas", "cache_events", "events_seq", "room")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SEQ_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[RequestDelta]
    cache_events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    events_seq: int
    room: KVRoom
    def __init__(self, deltas: _Optional[_Iterable[_Union[RequestDelta, _Mapping]]] = ..., cache_events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., events_seq: _Optional[int] = ..., room: _Optional[_Union[KVRoom, _Mapping]] = ...) -> None: ...

class KVRoom(_message.Message):
    __slots__ = ("free_blocks", "total_blocks")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    total_blocks: int
    def __init__(self, free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("worker", "stored", "removed", "host")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    worker: str
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    host: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker: _Optional[str] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., host: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RequestDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "num_output_tokens", "num_cached_tokens", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finished: bool
    finish_reason: str
    num_output_tokens: int
    num_cached_tokens: int
    error: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
