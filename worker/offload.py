"""A host-memory tier under the device's KV cache (``--offload-gb``): blocks the device pool
evicts are kept here, least recently used dropped first, and a prompt whose next blocks are here
loads them back instead of computing them.

Copies run on a thread of their own, never on the step path:

- a cached block freed on the device (an eviction candidate) is copied out, in batches
  (``stage``): a staged copy is not this tier's yet, the device still holds the block;
- when the device pool takes the block for reuse (``evicted``), a finished staged copy becomes
  this tier's (events: removed from the device, then stored here); an unfinished one is dropped,
  since the block is about to be overwritten, and never waited for;
- a prompt admitted with blocks here gets device blocks held for them, as for a transfer from a
  peer (``LLMEngine.add_awaiting_kv``); the thread copies them in (``load``), and the request is
  scheduled once they have landed (``take_landed``); they leave this tier as the device caches
  them (``cached``: events removed here, then stored on the device).

A hash is cached in one tier at a time, so replaying the events without reading their medium
still gives every hash the worker holds. An entry's life::

    stage      thread copied it     the device evicts the block     load         landed
    PENDING -> STAGED ------------> CACHED -----------------------> LOADING ---> gone
       |         (device evicts: stays STAGED while another        (not landed: CACHED)
       |          block still caches the hash)
       +-- the device evicts the block before the copy is done: dropped
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvswitch.cache_index.events import HOST, BlockRemoved, BlockStored, CacheEvent
from kvswitch.worker.block_pool import BlockPool, KVBlock

logger = logging.getLogger(__name__)


class _State(enum.Enum):
    PENDING = "pending"  # staged, its copy not started
    COPYING = "copying"  # staged, the thread copying it
    STAGED = "staged"  # copied; the device still caches the block
    CACHED = "cached"  # this tier's: the device evicted it
    LOADING = "loading"  # being copied back into device blocks


@dataclass(slots=True)
class _Entry:
    slot: int
    state: _State
    source: int = -1  # the device block a staged copy reads


@dataclass(slots=True)
class OffloadStats:
    num_staged: int = 0  # blocks copied out
    num_offloaded: int = 0  # staged copies that became this tier's as the device evicted them
    num_dropped: int = 0  # staged copies dropped: evicted on the device before they were done
    num_evicted: int = 0  # this tier's blocks dropped for room (least recently used)
    num_loaded: int = 0  # blocks copied back into the device's cache
    load_s: float = 0.0  # time the thread spent copying blocks back, in all
    load_bytes: int = 0  # what those copies moved


@dataclass(slots=True)
class _Load:
    request_id: str
    hashes: list[bytes]
    pairs: list[tuple[int, int]] = field(default_factory=list)  # (slot, device block id)


class HostTier:
    def __init__(
        self,
        device_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_blocks: int,
        *,
        emit: Callable[[CacheEvent], None],
        start: bool = True,
    ) -> None:
        """``num_blocks`` blocks shaped as ``device_caches``' (pinned where those are on a GPU);
        ``emit`` queues this tier's events in order with the device pool's. ``start`` False:
        the copying thread waits for ``start()`` (tests hold copies back with it)."""
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        key = device_caches[0][0]
        pin = key.device.type == "cuda"
        shape = (num_blocks, *key.shape[1:])
        self.num_blocks = num_blocks
        self.caches = [
            tuple(torch.empty(shape, dtype=key.dtype, pin_memory=pin) for _ in range(2))
            for _ in device_caches
        ]
        self._device = device_caches
        self._emit = emit
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._reserved: set[int] = set()  # slots of dropped copies the thread still writes
        self._loads: dict[Hashable, _Load] = {}
        self._landed: list[Hashable] = []
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[tuple[str, object] | None] = queue.SimpleQueue()
        self._progress = threading.Event()  # set as each copy ends
        # Called on the thread as each copy ends (the engine core wakes its loop with it).
        self.on_progress: Callable[[], None] | None = None
        self.stats = OffloadStats()
        # On a GPU the copies run on a stream of their own, beside the steps' kernels.
        self._stream = torch.cuda.Stream(key.device) if pin else None
        self._thread = threading.Thread(target=self._run, name="kvswitch-offload", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout_s: float) -> None:
        """Until a copy ends, or ``timeout_s``: an idle engine waits here, not spinning against
        the thread for the interpreter's lock."""
        self._progress.wait(timeout_s)
        self._progress.clear()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every copy queued so far is done; False if ``timeout_s`` passed first."""
        done = threading.Event()
        self._work.put(("flush", done))
        return done.wait(timeout_s)

    @property
    def bytes_per_block(self) -> int:
        key = self.caches[0][0]
        return 2 * len(self.caches) * key[0].numel() * key.element_size()

    @property
    def num_cached_blocks(self) -> int:
        with self._lock:
            return sum(e.state is _State.CACHED for e in self._entries.values())

    def cached_hashes(self) -> set[bytes]:
        """The hashes this tier caches (not those staged, which the device still caches)."""
        with self._lock:
            return {h for h, e in self._entries.items() if e.state is _State.CACHED}

    @property
    def num_loads(self) -> int:
        """Loads not landed yet (or landed and not taken)."""
        return len(self._loads)

    @property
    def num_copies(self) -> int:
        """Copies in flight: blocks being copied out, loads not landed (or not taken)."""
        with self._lock:
            copying = (_State.PENDING, _State.COPYING)
            num_out = sum(e.state in copying for e in self._entries.values())
            return num_out + len(self._reserved) + len(self._loads)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()

    # -- the device pool's hooks (the engine's thread) -----------------------------------------

    def stage(self, blocks: Sequence[KVBlock]) -> None:
        """Copy these freed cached blocks out, unless this tier has their hashes already."""
        batch = []
        with self._lock:
            entries = self._entries
            for block in blocks:
                block_hash = block.block_hash
                assert block_hash is not None
                entry = entries.get(block_hash)
                if entry is not None:
                    entries.move_to_end(block_hash)
                    continue
                slot = self._take_slot()
                if slot is None:
                    break
                entries[block_hash] = _Entry(slot, _State.PENDING, block.block_id)
                batch.append(block_hash)
        if batch:
            self._work.put(("stage", batch))

    def evicted(self, items: Sequence[tuple[int, bytes, bool]]) -> None:
        """The device pool took these blocks for reuse: ``(block id, hash, whether the hash
        left its cache)``. A staged copy of a hash that left becomes this tier's; one whose copy
        is not done is dropped (the block is about to be written)."""
        offloaded = []
        with self._lock:
            for block_id, block_hash, left in items:
                entry = self._entries.get(block_hash)
                if entry is None:
                    continue
                if entry.state in (_State.PENDING, _State.COPYING):
                    if entry.source != block_id:
                        continue  # another block's copy of the same hash: it reads that one
                    del self._entries[block_hash]
                    if entry.state is _State.PENDING:
                        self._free_slots.append(entry.slot)
                    else:
                        self._reserved.add(entry.slot)  # the thread frees it when done
                    self.stats.num_dropped += 1
                elif entry.state is _State.STAGED and left:
                    entry.state, entry.source = _State.CACHED, -1
                    self._entries.move_to_end(block_hash)
                    offloaded.append(block_hash)
            self.stats.num_offloaded += len(offloaded)
        if offloaded:
            self._emit(BlockStored(tuple(offloaded), medium=HOST))

    def cached(self, block_hashes: Sequence[bytes]) -> None:
        """The device cached these hashes: this tier lets go of its own (a reload landed, or
        the device computed them again)."""
        removed = []
        with self._lock:
            for block_hash in block_hashes:
                entry = self._entries.get(block_hash)
                if entry is not None and entry.state in (_State.CACHED, _State.LOADING):
                    del self._entries[block_hash]
                    self._free_slots.append(entry.slot)
                    removed.append(block_hash)
        if removed:
            self._emit(BlockRemoved(tuple(removed), medium=HOST))

    # -- loads ----------------------------------------------------------------------------------

    def num_leading_cached(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes this tier holds (and may load)."""
        with self._lock:
            for i, block_hash in enumerate(block_hashes):
                entry = self._entries.get(block_hash)
                if entry is None or entry.state is not _State.CACHED:
                    return i
            return len(block_hashes)

    def load(self, tag: Hashable, request_id: str, targets: dict[bytes, int]) -> int:
        """Copy the blocks named by ``targets`` (hash -> the device block awaiting it) in, on
        the thread; ``take_landed`` says when. Only hashes still held here are loaded: their
        number is returned."""
        job = _Load(request_id, [])
        with self._lock:
            for block_hash, block_id in targets.items():
                entry = self._entries.get(block_hash)
                if entry is None or entry.state is not _State.CACHED:
                    continue
                entry.state = _State.LOADING
                self._entries.move_to_end(block_hash)
                job.hashes.append(block_hash)
                job.pairs.append((entry.slot, block_id))
            if not job.pairs:
                return 0
            self._loads[tag] = job
        self._work.put(("load", tag))
        return len(job.pairs)

    def take_landed(self) -> list[tuple[Hashable, str]]:
        """The loads whose blocks have landed since the last call: ``(tag, request id)``."""
        with self._lock:
            landed, self._landed = self._landed, []
            return [(tag, self._loads[tag].request_id) for tag in landed]

    def finish_load(self, tag: Hashable) -> None:
        """The landed load is taken: blocks the device did not cache stay this tier's."""
        with self._lock:
            job = self._loads.pop(tag)
            for block_hash in job.hashes:
                entry = self._entries.get(block_hash)
                if entry is not None and entry.state is _State.LOADING:
                    entry.state = _State.CACHED
            self.stats.num_loaded += len(job.pairs)

    def clear(self) -> None:
        """Forget every staged and cached block (the device pool was reset; its event covers
        this tier too)."""
        with self._lock:
            for block_hash, entry in list(self._entries.items()):
                if entry.state is _State.LOADING:
                    continue
                del self._entries[block_hash]
                if entry.state is _State.COPYING:
                    self._reserved.add(entry.slot)
                else:
                    self._free_slots.append(entry.slot)

    def check_integrity(self, pool: BlockPool) -> None:
        """Every slot is used once (an entry's, free, or a dropped copy's still being written),
        and no hash this tier caches is cached on the device too."""
        with self._lock:
            used = [e.slot for e in self._entries.values()]
            slots = used + self._free_slots + sorted(self._reserved)
            assert sorted(slots) == list(range(self.num_blocks)), "host slots out of sync"
            for block_hash, entry in self._entries.items():
                if entry.state is _State.CACHED:
                    assert pool.get_cached_block(block_hash) is None, (
                        f"{block_hash.hex()[:8]} is cached in both tiers"
                    )

    # -- internals ------------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A free slot, dropping the least recently used cached or staged block for it (under
        the lock); None when every block is being copied."""
        if self._free_slots:
            return self._free_slots.pop()
        for block_hash, entry in self._entries.items():
            if entry.state in (_State.CACHED, _State.STAGED):
                del self._entries[block_hash]
                self.stats.num_evicted += 1
                if entry.state is _State.CACHED:
                    self._emit(BlockRemoved((block_hash,), medium=HOST))
                return entry.slot
        return None

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            kind, payload = item
            if kind == "flush":
                payload.set()  # type: ignore[attr-defined]
                continue
            try:
                with (
                    torch.cuda.stream(self._stream)
                    if self._stream is not None
                    else contextlib.nullcontext()
                ):
                    if kind == "stage":
                        self._copy_out(payload)  # type: ignore[arg-type]
                    else:
                        self._copy_in(payload)
            except Exception:
                logger.exception("the host tier's %s copy failed", kind)
            self._progress.set()
            if self.on_progress is not None:
                self.on_progress()

    @torch.inference_mode()
    def _copy_out(self, block_hashes: list[bytes]) -> None:
        with self._lock:
            jobs = []
            for block_hash in block_hashes:
                entry = self._entries.get(block_hash)
                if entry is not None and entry.state is _State.PENDING:
                    entry.state = _State.COPYING
                    jobs.append((block_hash, entry))
            pairs = [(entry.slot, entry.source) for _, entry in jobs]
        if not pairs:
            return
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        sources = torch.tensor([b for _, b in pairs], dtype=torch.int64)
        device_sources = sources.to(self._device[0][0].device)
        for host, device in zip(self.caches, self._device, strict=True):
            for host_part, device_part in zip(host, device, strict=True):
                host_part.index_copy_(0, slots, device_part.index_select(0, device_sources).cpu())
        with self._lock:
            for block_hash, entry in jobs:
                if self._entries.get(block_hash) is entry:
                    entry.state = _State.STAGED
                    self.stats.num_staged += 1
                else:  # dropped while copied: its slot is free now
                    self._reserved.discard(entry.slot)
                    self._free_slots.append(entry.slot)

    @torch.inference_mode()
    def _copy_in(self, tag: Hashable) -> None:
        with self._lock:
            job = self._loads[tag]
        start = time.perf_counter()
        device = self._device[0][0].device
        slots = torch.tensor([s for s, _ in job.pairs], dtype=torch.int64)
        targets = torch.tensor([b for _, b in job.pairs], dtype=torch.int64, device=device)
        for host, target in zip(self.caches, self._device, strict=True):
            for host_part, device_part in zip(host, target, strict=True):
                rows = host_part.index_select(0, slots).to(device, non_blocking=True)
                device_part.index_copy_(0, targets, rows)
        if self._stream is not None:
            self._stream.synchronize()
        with self._lock:
            self.stats.load_s += time.perf_counter() - start
            self.stats.load_bytes += len(job.pairs) * self.bytes_per_block
            self._landed.append(tag)
