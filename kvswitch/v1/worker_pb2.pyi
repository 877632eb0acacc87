from kvswitch.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdaptersResponse(_message.Message):
    __slots__ = ("loras",)
    LORAS_FIELD_NUMBER: _ClassVar[int]
    loras: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, loras: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "lora", "cache_salt", "num_resumed_tokens", "prompt_token_ids_u32le", "hold_blocks_ms", "kv_source", "num_pending_text_tokens", "pooling", "priority", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_U32LE_FIELD_NUMBER: _ClassVar[int]
    HOLD_BLOCKS_MS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    lora: str
    cache_salt: str
    num_resumed_tokens: int
    prompt_token_ids_u32le: bytes
    hold_blocks_ms: int
    kv_source: KVSource
    num_pending_text_tokens: int
    pooling: str
    priority: _common_pb2.Priority
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lora: _Optional[str] = ..., cache_salt: _Optional[str] = ..., num_resumed_tokens: _Optional[int] = ..., prompt_token_ids_u32le: _Optional[bytes] = ..., hold_blocks_ms: _Optional[int] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ..., num_pending_text_tokens: _Optional[int] = ..., pooling: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("peer_address", "transfer_id", "transport", "on_failure", "timeout_ms")
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ON_FAILURE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    peer_address: str
    transfer_id: str
    transport: str
    on_failure: str
    timeout_ms: int
    def __init__(self, peer_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., transport: _Optional[str] = ..., on_failure: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WorkerGenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.RequestStats
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.RequestStats, _Mapping]] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TokenChunk
    final: WorkerGenerateFinal
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TokenChunk, _Mapping]] = ..., final: _Optional[_Union[WorkerGenerateFinal, _Mapping]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("calls", "cancelled")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[StreamedCall]
    cancelled: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, calls: _Optional[_Iterable[_Union[StreamedCall, _Mapping]]] = ..., cancelled: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamedCall(_message.Message):
    __slots__ = ("call_id", "request", "timeout_ms")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    request: WorkerGenerateRequest
    timeout_ms: int
    def __init__(self, call_id: _Optional[int] = ..., request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[StreamedResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[StreamedResponse, _Mapping]]] = ...) -> None: ...

class StreamedResponse(_message.Message):
    __slots__ = ("call_id", "response", "status")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    response: WorkerGenerateResponse
    status: CallStatus
    def __init__(self, call_id: _Optional[int] = ..., response: _Optional[_Union[WorkerGenerateResponse, _Mapping]] = ..., status: _Optional[_Union[CallStatus, _Mapping]] = ...) -> None: ...

class CallStatus(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    class TrailingMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("worker_id", "num_running_requests", "num_waiting_requests", "num_queued_prefill_tokens", "num_free_blocks", "num_total_blocks", "block_size", "loras", "loaded_loras", "cpu_loras", "num_free_lora_slots", "num_host_blocks", "num_host_total_blocks", "num_host_copies")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    LOADED_LORAS_FIELD_NUMBER: _ClassVar[int]
    CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_COPIES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_running_requests: int
    num_waiting_requests: int
    num_queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    loras: _containers.RepeatedScalarFieldContainer[str]
    loaded_loras: _containers.RepeatedScalarFieldContainer[str]
    cpu_loras: _containers.RepeatedScalarFieldContainer[str]
    num_free_lora_slots: int
    num_host_blocks: int
    num_host_total_blocks: int
    num_host_copies: int
    def __init__(self, worker_id: _Optional[str] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., loras: _Optional[_Iterable[str]] = ..., loaded_loras: _Optional[_Iterable[str]] = ..., cpu_loras: _Optional[_Iterable[str]] = ..., num_free_lora_slots: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_host_total_blocks: _Optional[int] = ..., num_host_copies: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("max_hashes_per_chunk", "device_only")
    MAX_HASHES_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ONLY_FIELD_NUMBER: _ClassVar[int]
    max_hashes_per_chunk: int
    device_only: bool
    def __init__(self, max_hashes_per_chunk: _Optional[int] = ..., device_only: _Optional[bool] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("worker_id", "model", "block_size", "event_seq", "block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    block_size: int
    event_seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ..., event_seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes", "max_chunk_bytes", "shm_path", "transfer_id", "mapped", "host_id", "nixl")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    max_chunk_bytes: int
    shm_path: str
    transfer_id: str
    mapped: bool
    host_id: str
    nixl: bool
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., max_chunk_bytes: _Optional[int] = ..., shm_path: _Optional[str] = ..., transfer_id: _Optional[str] = ..., mapped: _Optional[bool] = ..., host_id: _Optional[str] = ..., nixl: _Optional[bool] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVBlockChunk(_message.Message):
    __slots__ = ("layout", "first_block", "num_blocks", "data", "cache_file", "cache_num_blocks", "block_ids", "lease_id", "host_id", "nixl_peer_info")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CACHE_FILE_FIELD_NUMBER: _ClassVar[int]
    CACHE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_PEER_INFO_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    first_block: int
    num_blocks: int
    data: bytes
    cache_file: str
    cache_num_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    host_id: str
    nixl_peer_info: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ..., cache_file: _Optional[str] = ..., cache_num_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., host_id: _Optional[str] = ..., nixl_peer_info: _Optional[bytes] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("request_id", "peer_address", "block_hashes", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    peer_address: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    transport: str
    def __init__(self, request_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., transport: _Optional[str] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("num_cached_blocks", "num_transferred_blocks", "num_transferred_bytes", "transport")
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    num_cached_blocks: int
    num_transferred_blocks: int
    num_transferred_bytes: int
    transport: str
    def __init__(self, num_cached_blocks: _Optional[int] = ..., num_transferred_blocks: _Optional[int] = ..., num_transferred_bytes: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class ReleaseBlocksRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
