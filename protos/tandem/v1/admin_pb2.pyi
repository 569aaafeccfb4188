from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleRequest(_message.Message):
    __slots__ = ("prefill", "decode", "drain_timeout_s")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    drain_timeout_s: float
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("prefill", "decode")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class ReconcileIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReconcileIndexReply(_message.Message):
    __slots__ = ("checked_workers", "checked_entries", "stale_entries", "missing_entries", "unreachable", "stale_by_worker")
    class StaleByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CHECKED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    STALE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MISSING_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    STALE_BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    checked_workers: int
    checked_entries: int
    stale_entries: int
    missing_entries: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    stale_by_worker: _containers.ScalarMap[str, int]
    def __init__(self, checked_workers: _Optional[int] = ..., checked_entries: _Optional[int] = ..., stale_entries: _Optional[int] = ..., missing_entries: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ..., stale_by_worker: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "role", "in_flight", "free_blocks", "total_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    in_flight: int
    free_blocks: int
    total_blocks: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., in_flight: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ...) -> None: ...
