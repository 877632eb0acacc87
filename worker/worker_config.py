"""What a worker is started with: ``WorkerConfig``, which the ``kvswitch worker`` options fill,
and the limits of its server."""

from __future__ import annotations

import dataclasses

from kvswitch.cache_index.connect import DEFAULT_PREFIX
from kvswitch.cache_index.hashing import BlockNaming
from kvswitch.cache_index.index import ROLES
from kvswitch.cache_index.vllm_publisher import KVEventsConfig
from kvswitch.security import (
    API_KEYS_ENV,
    FLEET_WAYS_OUT,
    FleetSecurity,
    check_exposure,
    is_loopback,
    parse_api_keys,
)
from kvswitch.worker.engine_config import EngineConfig
from kvswitch.worker.scheduler import SchedulerConfig

DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens 0 means this
# A request holds its prompt as token ids, 4 bytes each: this takes a context of 16M tokens
# (the router refuses larger prompts first, and the engine any its context cannot hold).
MAX_REQUEST_BYTES = 64 << 20
# A worker at its queue limit asks callers to wait this long before trying it again (trailing
# metadata of its RESOURCE_EXHAUSTED).
RETRY_AFTER_MS = 100
# How the worker's HTTP API is guarded beyond loopback.
HTTP_WAYS_OUT = (
    f"API keys (--api-key or {API_KEYS_ENV}; or the fleet token)",
    FLEET_WAYS_OUT[1],
)
# 64K hashes of 16 bytes make a 1 MiB message, well under gRPC's default 4 MiB limit.
MAX_HASHES_PER_CHUNK = 65536


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Where a worker listens and how its engine is built (see ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 50061  # 0 = a free port chosen by the OS
    worker_id: str = ""  # empty = "<host>:<port>" (the machine's name for a wildcard host)
    model: str = ""  # a Hugging Face checkpoint directory; empty = the built-in tiny model
    served_model_name: str = ""  # the block-hash namespace; empty = derived from the model
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20
    gpu_memory_fraction: float = 0.0  # on CUDA, in (0, 1): size the KV cache from free memory
    enable_prefix_caching: bool = True
    kv_cache_shm: bool = False  # CPU: the KV cache in shared memory, for same-host peers to copy
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cuda_graphs: bool | None = None  # CUDA: steps replayed from captured graphs; None: on CUDA
    # Requests that may wait for a place in the batch; past them, Generate answers
    # RESOURCE_EXHAUSTED (the router tries another worker) instead of queueing without bound.
    # NOTE: a request admitted behind a full batch waits about max_waiting_requests /
    # max_num_seqs request times: as many as run, it is at most twice as slow as at capacity.
    max_waiting_requests: int = 64
    # A stream's chunks carry at least this many tokens (the first token and the last ones go at
    # once): fewer messages for the router to relay, each token later by up to this many steps.
    stream_interval: int = 1
    cpu_threads: int = 0  # CPU: torch's threads for a step; 0 = one per core
    check_integrity: bool = False  # check the KV cache's invariants whenever the engine is idle
    max_hashes_per_chunk: int = 4096  # Snapshot's default chunk size
    index: str = ""  # block-hash index URL to publish cache events to; empty = none
    index_prefix: str = DEFAULT_PREFIX  # a Redis index's keys start with it (fleets share a Redis)
    # What the router sends here: whole requests ("both"), prompts to prefill for a decode
    # worker ("prefill"), or requests whose prompt another worker prefilled ("decode").
    role: str = "both"
    grace_s: float = 5.0  # on shutdown, how long running requests may finish
    metrics_port: int = -1  # Prometheus /metrics on host:metrics_port; -1 = none, 0 = a free port
    # Run the engine core on a thread of the serving process instead of a process of its own:
    # one process to debug or profile, at the cost of sharing its GIL with token streaming.
    engine_in_process: bool = False
    # Listen beyond loopback without the fleet token or mutual TLS (kvswitch/security.py).
    insecure: bool = False
    # Serve PullBlocks, which pulls blocks from whatever peer its caller names: for benchmarks
    # and tests on one machine (off, it answers PERMISSION_DENIED).
    allow_pull_blocks: bool = False
    # Every gRPC hop (kvswitch/security.py): TLS when tls_cert is set, mutual with
    # tls_client_auth; fleet_token: what routers and workers present to each other.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_client_auth: bool = False
    fleet_token: str = ""
    # How blocks are named (cache_index/hashing.py): xxh3, blake2b-keyed (keyed by a key derived
    # from fleet_token), or "" = blake2b-keyed when there is a fleet token, else xxh3.
    block_hash: str = ""
    # Publish cache events as a vLLM engine does, for routers that read vLLM's (JSON, vLLM's
    # --kv-events-config fields; "" = none).
    kv_events_config: str = ""
    # The worker's own OpenAI-compatible HTTP API, as a vLLM server's (worker/openai_api.py):
    # -1 = none, 0 = a free port. api_key: what its clients must send (comma-separated keys);
    # "" = the fleet token, if any.
    http_port: int = -1
    api_key: str = ""
    # LoRA adapters (EngineConfig's lora, enable_lora, max_loras, max_lora_rank, max_cpu_loras).
    lora: tuple[str, ...] = ()
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int = 0
    # The final hidden states cached per block (EngineConfig's cache_hidden_states).
    cache_hidden_states: bool = False
    hidden_cache_bytes: int = 0
    offload_gb: float = 0.0  # EngineConfig's: a host-memory tier of KV blocks

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        check_exposure(
            "the worker",
            self.host,
            self.port,
            FLEET_WAYS_OUT,
            guarded=self.security().authenticates_callers,
            insecure=self.insecure,
        )
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be -1 or in [0, 65535], got {self.http_port}")
        if parse_api_keys(self.api_key) and self.http_port < 0:
            raise ValueError("api_key is for the HTTP API: serve it with --http-port too")
        if self.http_port >= 0:
            check_exposure(
                "the worker's HTTP API",
                self.host,
                self.http_port,
                API_KEYS_ENV,
                guarded=bool(self.http_keys()) or self.security().tls_client_auth,
                insecure=self.insecure,
            )
        if self.allow_pull_blocks and not (is_loopback(self.host) or self.insecure):
            raise ValueError(
                "allow_pull_blocks lets a caller name any peer to pull from: it is for "
                f"benchmarks on one machine (--host 127.0.0.1), not on {self.host!r}, unless "
                "you pass --insecure"
            )
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be -1 (off) or in [0, 65535], got {self.metrics_port}"
            )
        if not 0 < self.max_hashes_per_chunk <= MAX_HASHES_PER_CHUNK:
            raise ValueError(
                f"max_hashes_per_chunk must be in [1, {MAX_HASHES_PER_CHUNK}], "
                f"got {self.max_hashes_per_chunk}"
            )
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        exposed = self.kv_events().exposed_endpoints()
        if exposed and not self.insecure:
            raise ValueError(
                f"kv_events_config binds {', '.join(exposed)} beyond this machine, and its "
                "events carry prompts' tokens, in the clear, to whoever connects: on one "
                "machine publish on ipc:// or tcp://[::1]:PORT; across machines, behind a "
                "network policy, pass --insecure"
            )
        # The engine's own configs check the rest, with their messages.
        self.engine_config()
        self.security()
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens)

    def security(self) -> FleetSecurity:
        return FleetSecurity.of(self)

    def http_keys(self) -> tuple[str, ...]:
        """What an HTTP client may present: the API keys, else the fleet token; () = none."""
        return parse_api_keys(self.api_key) or ((self.fleet_token,) if self.fleet_token else ())

    def block_naming(self) -> BlockNaming:
        """How this worker names blocks; the routers must name them alike."""
        return BlockNaming.from_fleet_token(self.fleet_token, self.block_hash)

    def engine_config(self) -> EngineConfig:
        """The engine's config: every ``EngineConfig`` field but ``block_naming`` (made from
        ``fleet_token`` and ``block_hash``) and ``record_block_tokens`` (on when vLLM-format
        events are published) has a field of the same name here."""
        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(EngineConfig)
            if f.name not in ("block_naming", "record_block_tokens")
        }
        return EngineConfig(
            **{
                **values,
                "model": self.model or None,
                "block_naming": self.block_naming(),
                "record_block_tokens": self.kv_events().publishes,
            }
        )

    def kv_events(self) -> KVEventsConfig:
        return KVEventsConfig.from_json(self.kv_events_config)
