from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ApplyStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    APPLY_STATUS_UNSPECIFIED: _ClassVar[ApplyStatus]
    APPLY_STATUS_APPLIED: _ClassVar[ApplyStatus]
    APPLY_STATUS_DUPLICATE: _ClassVar[ApplyStatus]
    APPLY_STATUS_NEEDS_RESYNC: _ClassVar[ApplyStatus]
    APPLY_STATUS_UNKNOWN_WORKER: _ClassVar[ApplyStatus]
APPLY_STATUS_UNSPECIFIED: ApplyStatus
APPLY_STATUS_APPLIED: ApplyStatus
APPLY_STATUS_DUPLICATE: ApplyStatus
APPLY_STATUS_NEEDS_RESYNC: ApplyStatus
APPLY_STATUS_UNKNOWN_WORKER: ApplyStatus

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "namespace", "block_size", "role", "num_blocks", "max_model_len", "block_hash", "block_hash_key_id", "degraded")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    namespace: str
    block_size: int
    role: str
    num_blocks: int
    max_model_len: int
    block_hash: str
    block_hash_key_id: str
    degraded: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., namespace: _Optional[str] = ..., block_size: _Optional[int] = ..., role: _Optional[str] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_hash: _Optional[str] = ..., block_hash_key_id: _Optional[str] = ..., degraded: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "ttl_s")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    ttl_s: float
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "ttl_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    ttl_s: float
    def __init__(self, worker_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("alive",)
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    alive: bool
    def __init__(self, alive: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LiveWorkersRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class LiveWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("worker_id", "seq", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ...) -> None: ...

class ApplyResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: ApplyStatus
    def __init__(self, status: _Optional[_Union[ApplyStatus, str]] = ...) -> None: ...

class ResyncChunk(_message.Message):
    __slots__ = ("worker_id", "seq", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ResyncResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("worker_to_num_matched_blocks",)
    class WorkerToNumMatchedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_TO_NUM_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_to_num_matched_blocks: _containers.ScalarMap[str, int]
    def __init__(self, worker_to_num_matched_blocks: _Optional[_Mapping[str, int]] = ...) -> None: ...

class WorkerBlockHashesRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class BlockHashChunk(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_workers", "num_entries", "memory_bytes")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    num_entries: int
    memory_bytes: int
    def __init__(self, num_workers: _Optional[int] = ..., num_entries: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class ReclaimExpiredRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReclaimExpiredResponse(_message.Message):
    __slots__ = ("num_workers",)
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    def __init__(self, num_workers: _Optional[int] = ...) -> None: ...
