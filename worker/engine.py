"""The inference engine: schedule, run the model, sample, and hand out what each request produced.

``step()`` is the whole loop body::

    scheduled = scheduler.schedule()        # who computes how many tokens
    logits = runner.execute_batch(batch)    # one forward pass over the packed batch
    outputs = postprocess(scheduled, logits)   # sample, stop, free finished requests: StepOutputs

The engine is synchronous and single-threaded; the gRPC server drives it from its own thread.

A step that raises fails only the requests it ran (``StepFailed`` names them) and leaves the cache
as if it had never run: blocks it cached for KV it did not write lose their hashes again.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvswitch.cache_index.events import CacheEvent
from kvswitch.cache_index.hashing import BlockHasher
from kvswitch.worker.cuda_graphs import graph_memory_bytes
from kvswitch.worker.engine_config import EngineConfig, check_lora_name, lora_paths
from kvswitch.worker.hidden_cache import HiddenStateCache
from kvswitch.worker.kv_cache_manager import KVCacheManager
from kvswitch.worker.kv_layout import KVLayout
from kvswitch.worker.kv_transfer import (
    PeerCaches,
    copy_peer_blocks,
    layout_of,
    new_cache_file,
    read_blocks,
    remove_cache_file,
    shared_file,
    write_blocks,
)
from kvswitch.worker.logprobs import pool, prompt_logprobs, rows_logprobs
from kvswitch.worker.lora import LoraManager, LoraSlots
from kvswitch.worker.model_runner import (
    ModelRunner,
    StepBatch,
    kv_cache_bytes_per_block,
    num_blocks_for_budget,
)
from kvswitch.worker.offload import HostTier
from kvswitch.worker.request import (
    INTERACTIVE,
    POOLINGS,
    PRIORITIES,
    FinishReason,
    FirstToken,
    PullSlots,
    Request,
    SamplingParams,
    StepFailed,
    StepOutputs,
    check_hold,
    check_prompt,
)
from kvswitch.worker.sampler import Sampler, make_generator, seed_for_position
from kvswitch.worker.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvswitch.worker.weights import load_model, model_namespace

if TYPE_CHECKING:
    from kvswitch.worker.nixl_kv import NixlKVAgent, PendingRead

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for the host tier's copies (it returns as one ends).
_HOST_WAIT_S = 0.005


def kv_cache_budget_bytes(config: EngineConfig, reserved_bytes: int = 0) -> int:
    """Bytes for the KV cache, decided once the model is loaded; ``reserved_bytes`` (what the
    CUDA graphs will take) is set aside first from the GPU's free memory."""
    if config.gpu_memory_fraction:
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(config.device))
        return int(max(free_bytes - reserved_bytes, 0) * config.gpu_memory_fraction)
    return config.kv_cache_bytes


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_step_tokens: int = 0  # summed over every step
    max_step_tokens: int = 0  # the largest step


def check_device(device: str) -> None:
    """ValueError, saying why, unless ``device`` is a torch device this process can use."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device {device!r} is not a torch device: use cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: this torch {torch.__version__} sees no CUDA GPU (a CPU "
                "build, or no GPU or driver here); use --device cpu"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: there are only {torch.cuda.device_count()} CUDA GPUs here"
            )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        check_device(config.device)
        dtype = getattr(torch, config.dtype)
        self.model = load_model(config.model, device=config.device, dtype=dtype)
        self.model_config = self.model.config
        # The adapters' device slots come before the KV cache, which takes what memory is left.
        self.loras: LoraManager | None = None
        if config.lora or config.enable_lora:
            slots = LoraSlots(
                self.model_config,
                max_loras=config.max_loras,
                max_rank=config.max_lora_rank,
                device=config.device,
                dtype=dtype,
            )
            self.loras = LoraManager(
                slots, lora_paths(config.lora), max_cpu_loras=config.max_cpu_loras
            )
        self._eos_token_ids = frozenset(self.model_config.eos_token_ids)
        graph_bytes = 0
        if config.cuda_graphs:
            graph_bytes = graph_memory_bytes(
                self.model_config,
                dtype.itemsize,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.model_config.max_position_embeddings,
                block_size=config.block_size,
            )
        num_blocks = num_blocks_for_budget(
            self.model, config.block_size, dtype, kv_cache_budget_bytes(config, graph_bytes)
        )
        self.namespace = model_namespace(config.model, config.served_model_name)
        self.kv_cache = KVCacheManager(
            num_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.kv_cache.record_tokens = config.record_block_tokens
        self.kv_cache_file = new_cache_file() if config.kv_cache_shm else None
        reserved_before = torch.cuda.memory_reserved(config.device) if config.cuda_graphs else 0
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            kv_cache_file=self.kv_cache_file,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        if self.loras is not None:
            self.runner.attach_loras(self.loras.slots)
        self.hidden_cache: HiddenStateCache | None = None
        if config.cache_hidden_states:
            self.hidden_cache = self.runner.hidden_cache = HiddenStateCache(
                num_blocks,
                config.block_size,
                self.model_config.hidden_size,
                dtype,
                max_bytes=config.hidden_cache_bytes or None,
            )
            logger.info(
                "hidden-state cache: %d KiB a block, %d blocks of %d (%.0f MiB of host memory)",
                self.hidden_cache.bytes_per_block // 1024,
                self.hidden_cache.num_blocks,
                num_blocks,
                self.hidden_cache.num_bytes / 2**20,
            )
        # The CUDA graphs' memory: (set aside for them, what capturing them took).
        self.graph_memory_bytes: tuple[int, int] | None = None
        if config.cuda_graphs:
            kv_bytes = num_blocks * kv_cache_bytes_per_block(self.model, config.block_size, dtype)
            taken = torch.cuda.memory_reserved(config.device) - reserved_before - kv_bytes
            self.graph_memory_bytes = (graph_bytes, taken)
            logger.info(
                "CUDA graphs: %.0f MiB set aside for them before sizing the KV cache (%d "
                "blocks, %.0f MiB); capture took %.0f MiB",
                graph_bytes / 2**20,
                num_blocks,
                kv_bytes / 2**20,
                taken / 2**20,
            )
        self.offload: HostTier | None = None
        if config.offload_gb:
            self.offload = self._host_tier(config.offload_gb)
        self._peer_caches = PeerCaches()  # same-host peers' caches, mapped
        self._nixl_agent: NixlKVAgent | None = None  # registered on first use
        self._nixl_writes: dict[Hashable, PendingRead] = {}  # posted reads, by tag
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                max_loras=config.max_loras if self.loras is not None else 0,
            ),
            self.kv_cache,
        )
        # A request that wants its prompt's hidden states counts a cached prefix only as far as
        # the hidden-state cache holds its rows (none without the cache): the rest is computed.
        hidden_cache = self.hidden_cache
        self.scheduler.num_hidden_blocks = (
            hidden_cache.num_cached_blocks if hidden_cache is not None else lambda blocks: 0
        )
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        # Running requests still gathering their prompt's hidden states.
        self._hidden_requests: dict[str, Request] = {}
        self.stats = EngineStats()
        # The rows of the latest step's requests, with the block tables' version they held in.
        self._last_rows: tuple[int, list[Request], np.ndarray] = (-1, [], np.empty(0, np.int64))

    def _host_tier(self, offload_gb: float) -> HostTier:
        """The host-memory tier under the KV cache, wired to the device pool's hooks."""
        pool = self.kv_cache.pool
        per_block = self.kv_layout.bytes_per_block
        num_blocks = int(offload_gb * 2**30) // per_block
        if num_blocks < 1:
            raise ValueError(f"offload_gb {offload_gb:g} holds no block of {per_block:,} bytes")
        tier = HostTier(self.runner.kv_caches, num_blocks, emit=pool.record_event)
        pool.on_evict, pool.on_free, pool.on_cache = tier.evicted, tier.stage, tier.cached
        self.kv_cache.tier = tier
        logger.info(
            "host tier: %d blocks (%.2f GiB) under the device's %d",
            num_blocks,
            num_blocks * per_block / 2**30,
            pool.num_blocks,
        )
        return tier

    @functools.cached_property
    def max_model_len(self) -> int:
        """Longest context (prompt plus output) one request may reach."""
        return min(
            self.model_config.max_position_embeddings,
            self.kv_cache.pool.num_blocks * self.config.block_size,
        )

    # -- requests --------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        **options: Any,
    ) -> None:
        """Queue a request. Raises ValueError, saying what is wrong, for a request that can
        never run; nothing is queued then. ``options`` are ``make_request``'s."""
        self.add(self.make_request(request_id, prompt_token_ids, params, **options))

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        num_resumed_tokens: int = 0,
        block_hashes: list[bytes] | None = None,
        hold_s: float = 0.0,
        pooling: str | None = None,
        priority: int = INTERACTIVE,
    ) -> Request:
        """The request ``add_request`` would queue, checked (ValueError) but not queued. It reads
        only what never changes in the engine, so any thread may call it.

        ``num_resumed_tokens``: the last this-many prompt tokens are output the request already
        produced elsewhere; a seeded request samples its next token as the one after them.
        ``block_hashes``: the prompt's chain (``self.hasher(cache_salt)``), when the caller
        hashed it already. ``hold_s``: once finished, the request's cached blocks are held this
        long under a lease named by its id, for a peer to copy (``release_lease``).
        ``pooling``: give the prompt's embedding, its final hidden states pooled this way
        (``POOLINGS``), with its first token. ``priority``: ``INTERACTIVE`` or ``BATCH`` (it
        waits behind every interactive request).
        """
        check_hold(hold_s)
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be 0 (interactive) or 1 (batch), not {priority!r}")
        if pooling is not None and pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
        prompt = np.asarray(prompt_token_ids)
        check_prompt(prompt, self.model_config.vocab_size, self.max_model_len, num_resumed_tokens)
        self.check_lora(lora)
        request = Request(
            request_id,
            prompt,
            self.hasher(cache_salt, lora),
            params,
            make_generator(params, self.runner.device),
            block_hashes=block_hashes,
        )
        request.num_resumed_tokens = num_resumed_tokens
        request.hold_s = hold_s
        request.pooling = pooling
        request.priority = priority
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        request.stop_token_ids |= self._eos_token_ids
        return request

    def add(self, request: Request) -> None:
        """Queue a request from ``make_request``; ValueError if its id is already running."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if self.offload is not None and self._load_from_host(request):
            return
        self.requests[request.request_id] = request
        if request.needs_prompt_hidden:
            self._hidden_requests[request.request_id] = request
        self.scheduler.add(request)

    def _load_from_host(self, request: Request) -> bool:
        """Queue a request whose prompt's next blocks after its device-cached prefix are in the
        host tier as one whose KV a transfer brings: those blocks are copied in, off the step
        path, and it is scheduled once they have landed. False (nothing done) for any other."""
        assert self.offload is not None
        if request.needs_prompt_hidden:
            return False  # the host tier keeps no hidden states: such a prompt is computed
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.config.block_size]
        num_on_device = len(self.kv_cache.pool.cached_prefix(hashes))
        num_in_host = self.offload.num_leading_cached(hashes[num_on_device:])
        if not num_in_host:
            return False
        slots = self.add_awaiting_kv(request)
        if slots.refused or slots.num_cached_blocks != num_on_device:
            self.kv_landed(request.request_id)  # no room to hold them: computed
            return True
        # NOTE: only the blocks the host tier holds land; the awaited ones after them are
        # computed (kv_landed caches the leading run that landed).
        loaded = hashes[num_on_device : num_on_device + num_in_host]
        targets = self.kv_cache.pull_targets(loaded)
        tag = ("host", request.request_id)
        self.kv_cache.begin_landing(tag, targets, loaded)
        blocks = {loaded[i]: block.block_id for i, block in targets.items()}
        if not self.offload.load(tag, request.request_id, blocks):
            self.kv_cache.end_landing(tag, written=False)
            self.kv_landed(request.request_id)
        return True

    def _take_host_loads(self) -> None:
        """Schedule the requests whose blocks from the host tier have landed."""
        assert self.offload is not None
        for tag, request_id in self.offload.take_landed():
            self.kv_cache.end_landing(tag, written=True)
            self.kv_landed(request_id)
            self.offload.finish_load(tag)

    def add_awaiting_kv(self, request: Request) -> PullSlots:
        """Queue a request from ``make_request`` whose prompt's KV a transfer brings from a peer:
        the blocks of its whole prompt are held for it now, and it is not scheduled until
        ``kv_landed``. The slots name the blocks awaiting the KV (the ``write_cached_blocks``
        calls that carry their hashes fill them, or a transport writes them by id); with
        refused slots (no room) it computes its prompt once ``kv_landed``. ValueError as
        ``add``."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if request.needs_prompt_hidden:
            raise ValueError(
                "prompt logprobs and embeddings are computed where the prompt is: a request "
                "that asks for them cannot take its prompt's KV from a peer"
            )
        slots = self.scheduler.add_awaiting_kv(request)
        self.requests[request.request_id] = request
        return slots

    def kv_landed(self, request_id: str, num_written_blocks: int = 0) -> int:
        """The transfer for a request of ``add_awaiting_kv`` is over, done or not: the leading
        awaited blocks that hold their KV are cached, the others are computed, and the request
        is scheduled. ``num_written_blocks``: leading awaited blocks a transport wrote by block
        id (the engine did not see it). Returns how many awaited blocks landed; 0 for a request
        that waits for no KV (finished, aborted or unknown)."""
        return self.scheduler.kv_landed(request_id, num_written_blocks)

    def hasher(self, cache_salt: str | None = None, lora: str | None = None) -> BlockHasher:
        """What names this engine's blocks for a request with this salt and adapter."""
        return BlockHasher(
            self.namespace,
            self.config.block_size,
            lora=lora,
            cache_salt=cache_salt,
            naming=self.config.block_naming,
        )

    def lora_report(self) -> tuple[list[str], list[str], list[str], int]:
        """The adapters served, those in a device slot, those in host memory, and the number
        of slots that hold none."""
        loras = self.loras
        if loras is None:
            return [], [], [], 0
        return loras.names, loras.in_slots, loras.in_host_memory, loras.num_free_slots

    def host_report(self) -> tuple[int, int, int]:
        """The host tier's cached blocks, its size in blocks, and its copies in flight."""
        tier = self.offload
        if tier is None:
            return 0, 0, 0
        return tier.num_cached_blocks, tier.num_blocks, tier.num_copies

    def load_lora(self, name: str, path: str) -> list[str]:
        """Serve the PEFT adapter in the folder ``path`` as ``name`` from now on; the adapters
        served. ValueError when the engine has no adapter slots, the name is taken or the
        adapter does not fit."""
        if self.loras is None:
            raise ValueError(
                "this worker has no LoRA slots: start it with --enable-lora (or a --lora)"
            )
        if not name or "=" in name or name == self.namespace:
            raise ValueError(
                f"lora_name: {name!r} cannot name an adapter (empty, with '=' or the model's name)"
            )
        self.loras.register(name, path)
        return self.loras.names

    def unload_lora(self, name: str) -> list[str]:
        """Stop serving the adapter ``name``; the adapters served. ValueError when it is not
        served, or while requests that name it run or wait (they would lose it)."""
        self.check_lora(name)
        assert self.loras is not None
        using = sum(r.hasher.lora == name for r in self.requests.values())
        if using:
            raise ValueError(
                f"lora: adapter {name!r} has {using} request(s) running or waiting; unload it "
                "once they end"
            )
        self.loras.unregister(name)
        return self.loras.names

    def check_lora(self, lora: str | None) -> None:
        """ValueError, naming the adapters served, unless ``lora`` is None or one of them."""
        check_lora_name(lora, self.loras.names if self.loras is not None else ())

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is not running."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.finish_reason = FinishReason.ABORT
        self._hidden_requests.pop(request_id, None)
        request.prompt_hidden = None
        self.scheduler.remove(request)
        return True

    def has_unfinished(self) -> bool:
        """Requests a step may run, or will once their blocks land from the host tier. (Blocks
        being copied out are no work of the steps': the engine core reports their end when the
        tier wakes it.)"""
        return self.scheduler.num_unfinished > 0 or (
            self.offload is not None and self.offload.num_loads > 0
        )

    def take_events(self) -> list[CacheEvent]:
        return self.kv_cache.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash this engine holds cached, on the device or in its host tier: what its
        events, replayed, give."""
        hashes = self.kv_cache.pool.cached_block_hashes()
        if self.offload is not None:
            hashes += sorted(self.offload.cached_hashes() - set(hashes))
        return hashes

    # -- cached blocks in and out ---------------------------------------------------------------

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """How this engine's blocks travel as bytes (``kv_transfer``)."""
        return layout_of(self.runner.kv_caches)

    def close(self) -> None:
        """Unmap the peers' caches and remove this engine's cache file, if it has one."""
        self._peer_caches.close()
        if self._nixl_agent is not None:
            self._nixl_agent.close()
            self._nixl_agent = None
        if self.kv_cache_file is not None:
            remove_cache_file(self.kv_cache_file)

    def hold_cached_blocks(
        self, block_hashes: Sequence[bytes], lease_id: str, hold_s: float
    ) -> list[int]:
        """The ids of the leading blocks of ``block_hashes`` cached here, held from eviction
        under ``lease_id`` for ``hold_s`` (a lease of that id held already holds these blocks
        now, for at least that long) for a same-host peer to copy out of this engine's cache
        file; ``release_lease`` lets them go."""
        check_hold(hold_s)
        blocks = self.kv_cache.pool.cached_prefix(block_hashes)
        self.kv_cache.hold_blocks(blocks, lease_id, time.monotonic(), hold_s)
        return [block.block_id for block in blocks]

    def write_cached_blocks_mapped(
        self,
        block_hashes: Sequence[bytes],
        peer_file: str,
        peer_num_blocks: int,
        peer_block_ids: Sequence[int],
    ) -> int:
        """``write_cached_blocks`` with the blocks copied straight out of a same-host peer's
        cache file (its ``hold_cached_blocks`` ids). ValueError if that file cannot be mapped."""
        if len(peer_block_ids) != len(block_hashes):
            raise ValueError(f"{len(peer_block_ids)} block ids for {len(block_hashes)} hashes")
        peer = self._peer_caches.get(peer_file, self.kv_layout, peer_num_blocks)

        def copy(positions: list[int], block_ids: list[int]) -> None:
            peer_ids = [peer_block_ids[i] for i in positions]
            copy_peer_blocks(self.runner.kv_caches, block_ids, peer, peer_ids)

        return self._put_cached_blocks(block_hashes, copy)

    def nixl_peer_info(self) -> bytes:
        """What a peer's NIXL agent needs to read this engine's blocks (``NixlPeerInfo``, as
        bytes); the KV cache is registered with an agent on first use. ValueError where NIXL
        is not installed."""
        return self._nixl().peer_info().to_bytes()

    def write_cached_blocks_nixl(
        self,
        tag: Hashable,
        block_hashes: Sequence[bytes],
        peer_info: bytes,
        peer_block_ids: Sequence[int],
        timeout_s: float | None = None,
    ) -> int | None:
        """``write_cached_blocks`` with the blocks read over NIXL straight out of a peer's KV
        cache (its ``nixl_peer_info``; the ids its ``hold_cached_blocks`` answered), one READ.

        When every block goes into a block that a pull awaits (the request flow), the read is
        posted and None returned: steps go on while it runs, and ``poll_nixl_writes`` says,
        under ``tag``, when it is over. Otherwise the read is waited for, and how many blocks
        were written returned. ValueError if the read fails (the holder gone, a timeout, at most
        ``nixl_kv.MAX_READ_S``): nothing it was to fill is cached."""
        if len(peer_block_ids) != len(block_hashes):
            raise ValueError(f"{len(peer_block_ids)} block ids for {len(block_hashes)} hashes")
        if tag in self._nixl_writes:
            raise ValueError(f"a NIXL write tagged {tag!r} is running already")
        from kvswitch.worker.nixl_kv import MAX_READ_S, NixlPeerInfo, NixlTransferError

        agent, peer = self._nixl(), NixlPeerInfo.from_bytes(peer_info)
        # NOTE: over before the holder's lease on the blocks can be (nixl_kv.MAX_READ_S).
        timeout_s = MAX_READ_S if timeout_s is None else min(timeout_s, MAX_READ_S)
        targets = self.kv_cache.pull_targets(block_hashes)
        try:
            if len(targets) < len(block_hashes):

                def copy(positions: list[int], block_ids: list[int]) -> None:
                    peer_ids = [peer_block_ids[i] for i in positions]
                    agent.read_blocks(peer, peer_ids, block_ids, timeout_s=timeout_s)

                return self._put_cached_blocks(block_hashes, copy)
            peer_ids = [peer_block_ids[i] for i in targets]
            block_ids = [block.block_id for block in targets.values()]
            pending = agent.post_read(peer, peer_ids, block_ids, timeout_s=timeout_s)
        except NixlTransferError as e:
            raise ValueError(f"NIXL read from {peer.agent_name} failed: {e}") from e
        self.kv_cache.begin_landing(tag, targets, block_hashes)
        self._nixl_writes[tag] = pending
        return None

    @property
    def num_nixl_writes(self) -> int:
        """NIXL reads ``write_cached_blocks_nixl`` posted that are not over yet."""
        return len(self._nixl_writes)

    def poll_nixl_writes(self) -> list[tuple[Hashable, int | ValueError]]:
        """The posted NIXL reads that are over, by tag: how many blocks each wrote (their
        requests may run), or why it failed (the blocks it was to fill are not cached)."""
        from kvswitch.worker.nixl_kv import NixlTransferError

        over: list[tuple[Hashable, int | ValueError]] = []
        for tag, pending in list(self._nixl_writes.items()):
            try:
                if pending.poll() is None:
                    continue
            except NixlTransferError as e:
                self.kv_cache.end_landing(tag, written=False)
                message = f"NIXL read from {pending.peer_name} failed: {e}"
                over.append((tag, ValueError(message)))
            else:
                over.append((tag, self.kv_cache.end_landing(tag, written=True)))
            del self._nixl_writes[tag]
        return over

    def _nixl(self) -> NixlKVAgent:
        if self._nixl_agent is None:
            from kvswitch.worker.nixl_kv import NixlKVAgent, NixlUnavailable

            # NOTE: a name of its own per engine: a restarted worker's agent is a new peer.
            name = f"kvswitch-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                self._nixl_agent = NixlKVAgent(self.runner.kv_caches, name=name)
            except NixlUnavailable as e:
                raise ValueError(str(e)) from e
        return self._nixl_agent

    def release_lease(self, lease_id: str) -> bool:
        """Let the blocks a finished request held for a peer go; False if none are held."""
        return self.kv_cache.release(lease_id)

    def release_expired_leases(self) -> list[str]:
        """Release the leases whose time is up; their ids."""
        return self.kv_cache.release_expired(time.monotonic())

    def read_cached_blocks(
        self,
        block_hashes: Sequence[bytes],
        with_data: bool = True,
        into: tuple[str, int] | None = None,
        lease_id: str | None = None,
    ) -> tuple[int, bytes]:
        """How many leading blocks of ``block_hashes`` this engine holds cached, and their KV as
        bytes (``kv_transfer``'s layout; empty without ``with_data``). With ``into`` (a file of
        this host's shared memory and an offset), the bytes are written there and b"" returned.
        Changes nothing in the cache: not even the blocks' eviction order. ``lease_id``: the
        lease the blocks are read under, extended by a lease's length (a peer still wants them).
        """
        if lease_id is not None:
            self.kv_cache.extend(lease_id, time.monotonic())
        block_ids = [block.block_id for block in self.kv_cache.pool.cached_prefix(block_hashes)]
        if not with_data:
            return len(block_ids), b""
        if into is None:
            return len(block_ids), read_blocks(self.runner.kv_caches, block_ids)
        path, offset = into
        size = len(block_ids) * self.kv_layout.bytes_per_block
        with shared_file(path, offset, size, writable=True) as out:
            read_blocks(self.runner.kv_caches, block_ids, out)
        return len(block_ids), b""

    def write_cached_blocks_from(
        self, block_hashes: Sequence[bytes], source: tuple[str, int]
    ) -> int:
        """``write_cached_blocks`` with the bytes read from a file of this host's shared memory
        (path, offset) where a peer wrote them."""
        path, offset = source
        size = len(block_hashes) * self.kv_layout.bytes_per_block
        with shared_file(path, offset, size, writable=False) as data:
            return self.write_cached_blocks(block_hashes, data)

    def write_cached_blocks(self, block_hashes: Sequence[bytes], data: bytes) -> int:
        """Put blocks computed elsewhere into this engine's cache. ``data`` is their KV from
        ``read_cached_blocks`` of an engine with the same layout. A hash that a request of
        ``add_awaiting_kv`` awaits goes into a block held for it (cached when it lands); any
        other goes into the prefix cache, as a request that computed and then freed it would
        have left it (evictable, the end of the chain first), said so in cache events. Hashes
        cached here already are skipped; when fewer blocks are free than are new, the leading
        ones are written. Returns how many blocks were written."""
        size = self.kv_layout.bytes_per_block
        if len(data) != len(block_hashes) * size:
            raise ValueError(
                f"{len(data):,} bytes for {len(block_hashes)} blocks of {size:,} bytes each"
            )

        def copy(positions: list[int], block_ids: list[int]) -> None:
            view = memoryview(data)
            chunk = (
                data
                if len(positions) == len(block_hashes)
                else b"".join(view[i * size : (i + 1) * size] for i in positions)
            )
            write_blocks(self.runner.kv_caches, block_ids, chunk)

        return self._put_cached_blocks(block_hashes, copy)

    def _put_cached_blocks(
        self, block_hashes: Sequence[bytes], copy: Callable[[list[int], list[int]], None]
    ) -> int:
        """``copy(positions in block_hashes, block ids)`` writing their KV into the blocks that
        pulls await, then the rest with ``BlockPool.take_cached_blocks``; how many were
        written."""
        if not self.kv_cache.enable_caching:
            raise ValueError("prefix caching is off on this worker: it cannot take cached blocks")
        targets = self.kv_cache.pull_targets(block_hashes)
        if targets:
            copy(list(targets), [block.block_id for block in targets.values()])
            self.kv_cache.fill(targets.values())
            if len(targets) == len(block_hashes):
                return len(targets)
        rest = [i for i in range(len(block_hashes)) if i not in targets]
        num_new = self.kv_cache.pool.take_cached_blocks(
            [block_hashes[i] for i in rest],
            lambda positions, blocks: copy(
                [rest[i] for i in positions], [block.block_id for block in blocks]
            ),
        )
        return len(targets) + num_new

    # -- the loop --------------------------------------------------------------------------------

    def step(self) -> StepOutputs:
        """Run one step and say what it produced; raises ``StepFailed`` (see there) if any part
        of it raises."""
        if self.offload is not None and self.offload.num_loads:
            self._take_host_loads()
        try:
            scheduled = self.scheduler.schedule()
        except Exception as e:
            # Unknown how far scheduling got: no request's state can be trusted.
            raise self._fail_step(list(self.requests), e) from e
        self.stats.num_preemptions += len(scheduled.preempted)
        if not scheduled.requests:
            if self.offload is not None and self.offload.num_loads:
                self.offload.wait(_HOST_WAIT_S)  # nothing to run until a load lands
            return StepOutputs()
        try:
            batch = self._batch(scheduled)
            if self.hidden_cache is None and not self._hidden_requests:
                logits = self.runner.execute_batch(batch)
            else:
                logits, hidden = self.runner.execute_batch_hidden(batch)
                if self._hidden_requests:
                    self._gather_prompt_hidden(scheduled, hidden)
        except Exception as e:
            raise self._fail_step([r.request_id for r in scheduled.requests], e) from e
        self.kv_cache.commit()
        if self.hidden_cache is not None:
            self._record_hidden_rows(scheduled)
        self.stats.num_steps += 1
        self.stats.num_step_tokens += scheduled.num_tokens
        self.stats.max_step_tokens = max(self.stats.max_step_tokens, scheduled.num_tokens)
        try:
            return self._postprocess(scheduled, logits)
        except Exception as e:
            raise self._fail_step([r.request_id for r in scheduled.requests], e) from e

    def _batch(self, scheduled: SchedulerOutput) -> StepBatch:
        """The step's sequences as arrays; their block tables come from the rows the KV cache
        manager keeps up to date, in one gather."""
        requests = scheduled.requests
        num_seqs = len(requests)
        if scheduled.num_tokens == num_seqs:
            # One token each, nearly always a decode, whose input is the last token.
            input_ids = np.array(
                [
                    r.last_token_id
                    if r.num_computed_tokens + 1 == r.num_tokens
                    else r.token_ids[r.num_computed_tokens]
                    for r in requests
                ],
                np.int64,
            )
        else:
            input_ids = np.concatenate(
                [
                    r.token_ids[start : start + num_new]
                    for r, start, num_new in zip(
                        requests, scheduled.start_pos, scheduled.num_new_tokens, strict=True
                    )
                ]
            )
        tables = self.kv_cache.block_tables
        # NOTE: decode after decode runs the same requests in the same order: while no row has
        # changed hands, their rows are the last step's (looking them up touches every id).
        last_version, last_requests, rows = self._last_rows
        if last_version != tables.version or last_requests != requests:
            rows = tables.rows([r.request_id for r in requests])
            self._last_rows = (tables.version, requests, rows)
        return StepBatch(
            input_ids=input_ids,
            start_pos=np.array(scheduled.start_pos, np.int64),
            num_new=np.array(scheduled.num_new_tokens, np.int64),
            block_tables=tables.gather(rows),
            lora_slots=self._lora_slots(scheduled) if self.loras is not None else None,
        )

    def _lora_slots(self, scheduled: SchedulerOutput) -> np.ndarray | None:
        """Each of the step's tokens' adapter slot (-1: the base model), its adapters put in
        slots first; None when no request of the step names one."""
        adapters = [r.hasher.lora for r in scheduled.requests]
        names = set(adapters) - {None}
        if not names:
            return None
        slot_of = self.loras.slots_for(names)
        per_request = [-1 if name is None else slot_of[name] for name in adapters]
        return np.repeat(np.array(per_request, np.int64), scheduled.num_new_tokens)

    def _gather_prompt_hidden(self, scheduled: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Copy the step's rows of prompts that want their hidden states into each request's
        buffer, after the rows of its cached prefix (from the hidden-state cache)::

            | cached prefix: rows from the cache | rows of earlier steps | this step's |
        """
        offset = 0
        for request, start, num_new in zip(
            scheduled.requests, scheduled.start_pos, scheduled.num_new_tokens, strict=True
        ):
            if request.request_id in self._hidden_requests:
                num_prompt = request.num_prompt_tokens
                if request.prompt_hidden is None:
                    request.prompt_hidden = torch.empty(
                        num_prompt, hidden.shape[1], dtype=hidden.dtype, device=hidden.device
                    )
                filled = request.num_hidden_rows
                if start > filled:
                    self._read_hidden_rows(request, filled, start)
                end = min(start + num_new, num_prompt)
                if end > start:
                    request.prompt_hidden[start:end] = hidden[offset : offset + end - start]
                request.num_hidden_rows = max(filled, end)
            offset += num_new

    def _read_hidden_rows(self, request: Request, start: int, end: int) -> None:
        """Rows [start, end) of the request's prompt, whole blocks of its cached prefix, from
        the hidden-state cache (the scheduler counted them cached only if it holds them)."""
        cache, size = self.hidden_cache, self.config.block_size
        if cache is None or start % size or end % size:
            raise RuntimeError(
                f"request {request.request_id!r}: prompt rows [{start}, {end}) are neither "
                "computed nor cached"
            )
        block_ids = self.kv_cache.get_block_ids(request.request_id)[start // size : end // size]
        assert request.prompt_hidden is not None
        request.prompt_hidden[start:end] = cache.read(block_ids).to(request.prompt_hidden.device)

    def _record_hidden_rows(self, scheduled: SchedulerOutput) -> None:
        """The blocks the step filled have every row in the hidden-state cache now."""
        assert self.hidden_cache is not None
        size = self.config.block_size
        for request, start, num_new in zip(
            scheduled.requests, scheduled.start_pos, scheduled.num_new_tokens, strict=True
        ):
            first, end = start // size, (start + num_new) // size
            if end > first:
                block_ids = self.kv_cache.get_block_ids(request.request_id)[first:end]
                self.hidden_cache.record(block_ids, request.block_hashes[first:end])

    def _prompt_extras(self, request: Request, outputs: StepOutputs) -> None:
        """The prompt logprobs and embedding of a request whose prompt is now computed."""
        del self._hidden_requests[request.request_id]
        hidden, request.prompt_hidden = request.prompt_hidden, None
        assert hidden is not None and request.num_hidden_rows == request.num_prompt_tokens
        prompt = request.token_ids[: request.num_prompt_tokens]
        num_top = request.params.prompt_logprobs
        if num_top is not None:
            outputs.prompt_logprobs[request.request_id] = prompt_logprobs(
                self.model, hidden[:-1], prompt, num_top
            )
        if request.pooling is not None:
            outputs.embeddings[request.request_id] = pool(hidden, request.pooling)

    def _fail_step(self, request_ids: list[str], cause: Exception) -> StepFailed:
        """Abort the step's requests, and any other that shares a block whose KV the step did
        not write, after taking those blocks' hashes back."""
        broken = self.kv_cache.discard_uncommitted()
        failed = list(dict.fromkeys([*request_ids, *broken]))
        for request_id in failed:
            self.abort(request_id)
        return StepFailed(failed, cause)

    def _postprocess(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> StepOutputs:
        # Only requests whose whole context is now computed produce a token; a prefill chunk
        # that stops short of the end throws its logits away.
        # NOTE: a step of decodes runs both loops once per request: they keep to local names
        # and build columns, not an object per request.
        requests = scheduled.requests
        sampling: list[Request] = []
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        sampling_rows = []
        for row, (request, num_new) in enumerate(
            zip(requests, scheduled.num_new_tokens, strict=True)
        ):
            request.num_computed_tokens = num_computed = request.num_computed_tokens + num_new
            if num_computed == request.num_tokens:
                sampling_rows.append(row)
                sampling.append(request)
                params.append(request.params)
                generator = request.generator  # only seeded sampled requests have one
                if generator is not None:
                    position = request.num_resumed_tokens + request.num_output_tokens
                    generator.manual_seed(seed_for_position(request.params.seed, position))
                generators.append(generator)
        outputs = StepOutputs([r.request_id for r in sampling])
        if not sampling:
            return outputs
        if len(sampling) < len(requests):
            logits = logits[sampling_rows]
        sampled = self.sampler.sample(logits, params, generators)
        outputs.token_ids = token_ids = sampled.tolist()
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if logprob_rows:
            rows = torch.tensor(logprob_rows, device=logits.device)
            for i, logprobs in zip(
                logprob_rows,
                rows_logprobs(
                    logits[rows], sampled[rows], [params[i].logprobs for i in logprob_rows]
                ),
                strict=True,
            ):
                outputs.logprobs[sampling[i].request_id] = logprobs
        now = time.monotonic()
        # A request ends on a stop token or EOS (STOP), or at max_tokens or the context length
        # (LENGTH), both folded into ``stop_token_ids`` and ``max_num_tokens`` on admission.
        first, finished = outputs.first, outputs.finished
        for request, token_id in zip(sampling, token_ids, strict=True):
            if request.first_token_s is None:
                request.first_token_s = now
                first[request.request_id] = FirstToken(
                    request.num_prompt_tokens, request.num_cached_tokens, now - request.arrival_s
                )
                self.stats.num_prompt_tokens += request.num_prompt_tokens
                self.stats.num_cached_tokens += request.num_cached_tokens
                if request.request_id in self._hidden_requests:
                    self._prompt_extras(request, outputs)
            request.append_token(token_id)
            if token_id in request.stop_token_ids:
                reason = FinishReason.STOP
            elif request.num_tokens >= request.max_num_tokens:
                reason = FinishReason.LENGTH
            else:
                continue
            request.finish_reason = finished[request.request_id] = reason
            if request.hold_s:
                self.kv_cache.hold(request, request.request_id, now, request.hold_s)
            self.scheduler.remove(request)
            del self.requests[request.request_id]
        return outputs

    # -- convenience ----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; returns each one's output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p)
        while self.has_unfinished():
            step = self.step()
            for request_id, token_id in zip(step.request_ids, step.token_ids, strict=True):
                outputs[request_id].append(token_id)
        return [outputs[request_id] for request_id in ids]
