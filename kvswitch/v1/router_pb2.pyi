from kvswitch.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids", "ids_u32le")
    IDS_FIELD_NUMBER: _ClassVar[int]
    IDS_U32LE_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    ids_u32le: bytes
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., ids_u32le: _Optional[bytes] = ...) -> None: ...

class RoutingOverrides(_message.Message):
    __slots__ = ("policy", "weights")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    weights: _containers.ScalarMap[str, float]
    def __init__(self, policy: _Optional[str] = ..., weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "lora", "cache_salt", "routing", "pooling", "priority", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    lora: str
    cache_salt: str
    routing: RoutingOverrides
    pooling: str
    priority: _common_pb2.Priority
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lora: _Optional[str] = ..., cache_salt: _Optional[str] = ..., routing: _Optional[_Union[RoutingOverrides, _Mapping]] = ..., pooling: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("worker_id", "policy", "reason", "num_matched_blocks", "score")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    policy: str
    reason: str
    num_matched_blocks: int
    score: float
    def __init__(self, worker_id: _Optional[str] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., num_matched_blocks: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "stats", "route")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.RequestStats
    route: RouteDecision
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.RequestStats, _Mapping]] = ..., route: _Optional[_Union[RouteDecision, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TokenChunk
    final: GenerateFinal
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...
