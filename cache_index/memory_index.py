"""The embedded block-hash index: in-process, the single-node default."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvswitch.cache_index.events import BlockRemoved, BlockStored, CacheEvent
from kvswitch.cache_index.hashing import HASH_BYTES
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, IndexStats, WorkerInfo, check_seq

_BYTES_PER_HASH_OBJECT = sys.getsizeof(b"\x00" * HASH_BYTES)


@dataclass(slots=True)
class _WorkerEntry:
    info: WorkerInfo
    expires_at: float
    bit: int  # this worker's bit in the hash -> workers masks
    last_seq: int = 0
    trusted: bool = True
    block_hashes: set[bytes] = field(default_factory=set)


class MemoryIndex(BlockIndex):
    """Each worker's hashes, and an inverted map from hash to a bit mask of the workers holding
    it, so that ``match`` is one walk down the chain (``clock``, monotonic seconds, is injectable
    for tests).

    Invariant: bit ``entry.bit`` is set in ``_hash_to_workers[h]`` exactly for the ``h`` in
    ``entry.block_hashes``, for every registered worker; a hash whose mask would be 0 is absent.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[str, _WorkerEntry] = {}
        self._hash_to_workers: dict[bytes, int] = {}
        self._free_bits: list[int] = []  # bits of workers gone, to reuse
        self._next_bit = 1

    def _live(self, worker_id: str) -> _WorkerEntry | None:
        entry = self._workers.get(worker_id)
        if entry is None or entry.expires_at <= self._clock():
            return None
        return entry

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        _check_ttl(ttl_s)
        old = self._workers.get(info.worker_id)
        if old is not None:
            self._set_hashes(old, set())
            bit = old.bit
        elif self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit << 1
        self._workers[info.worker_id] = _WorkerEntry(info, self._clock() + ttl_s, bit)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        _check_ttl(ttl_s)
        entry = self._live(worker_id)
        if entry is None:
            return False
        entry.expires_at = self._clock() + ttl_s
        return True

    async def deregister(self, worker_id: str) -> None:
        entry = self._workers.pop(worker_id, None)
        if entry is not None:
            self._forget(entry)

    async def live_workers(self, namespace: str | None = None) -> list[WorkerInfo]:
        now = self._clock()
        return sorted(
            (
                e.info
                for e in self._workers.values()
                if e.expires_at > now and (namespace is None or e.info.namespace == namespace)
            ),
            key=lambda info: info.worker_id,
        )

    async def apply(self, worker_id: str, seq: int, events: Sequence[CacheEvent]) -> ApplyStatus:
        check_seq(seq)
        entry = self._live(worker_id)
        if entry is None:
            return ApplyStatus.UNKNOWN_WORKER
        if seq <= entry.last_seq:
            return ApplyStatus.DUPLICATE
        if seq > entry.last_seq + 1 or not entry.trusted:
            entry.trusted = False
            return ApplyStatus.NEEDS_RESYNC
        self._apply(entry, events)
        entry.last_seq = seq
        return ApplyStatus.APPLIED

    async def resync(self, worker_id: str, seq: int, block_hashes: Iterable[bytes]) -> None:
        if seq < 0:
            raise ValueError(f"a snapshot's sequence number must be >= 0, got {seq}")
        entry = self._live(worker_id)
        if entry is None:
            raise KeyError(f"worker {worker_id!r} is not registered (or its registration lapsed)")
        self._set_hashes(entry, set(block_hashes))
        entry.last_seq = seq
        entry.trusted = True

    async def match(self, namespace: str, block_hashes: Sequence[bytes]) -> dict[str, int]:
        now = self._clock()
        result: dict[str, int] = {}
        bit_to_worker: dict[int, str] = {}
        for worker_id, entry in self._workers.items():
            if entry.expires_at > now and entry.trusted and entry.info.namespace == namespace:
                result[worker_id] = 0
                bit_to_worker[entry.bit] = worker_id
        # NOTE: one walk: the mask of workers holding every block so far only loses bits.
        mask = sum(bit_to_worker)
        get = self._hash_to_workers.get
        num_walked = 0
        for block_hash in block_hashes:
            held = get(block_hash, 0) & mask
            if held != mask:
                for bit, worker_id in bit_to_worker.items():
                    if mask & bit and not held & bit:
                        result[worker_id] = num_walked
                mask = held
                if not mask:
                    break
            num_walked += 1
        for bit, worker_id in bit_to_worker.items():
            if mask & bit:
                result[worker_id] = num_walked
        return result

    async def worker_block_hashes(self, worker_id: str) -> set[bytes]:
        entry = self._live(worker_id)
        return set(entry.block_hashes) if entry else set()

    async def stats(self) -> IndexStats:
        now = self._clock()
        live = [e for e in self._workers.values() if e.expires_at > now]
        num_entries = sum(len(e.block_hashes) for e in live)
        memory = sys.getsizeof(self._hash_to_workers)
        memory += sum(sys.getsizeof(e.block_hashes) for e in live)
        return IndexStats(len(live), num_entries, memory + num_entries * _BYTES_PER_HASH_OBJECT)

    async def reclaim_expired(self) -> int:
        now = self._clock()
        expired = [w for w, e in self._workers.items() if e.expires_at <= now]
        for worker_id in expired:
            self._forget(self._workers.pop(worker_id))
        return len(expired)

    # -- the inverted map ------------------------------------------------------------------------

    def _set_hashes(self, entry: _WorkerEntry, block_hashes: set[bytes]) -> None:
        """Make ``block_hashes`` the worker's set, in its entry and in the inverted map."""
        hash_to_workers, bit = self._hash_to_workers, entry.bit
        for block_hash in entry.block_hashes - block_hashes:
            self._unset(block_hash, bit)
        for block_hash in block_hashes - entry.block_hashes:
            hash_to_workers[block_hash] = hash_to_workers.get(block_hash, 0) | bit
        entry.block_hashes = block_hashes

    def _apply(self, entry: _WorkerEntry, events: Sequence[CacheEvent]) -> None:
        hash_to_workers, held, bit = self._hash_to_workers, entry.block_hashes, entry.bit
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    if block_hash not in held:
                        held.add(block_hash)
                        hash_to_workers[block_hash] = hash_to_workers.get(block_hash, 0) | bit
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash in held:
                        held.discard(block_hash)
                        self._unset(block_hash, bit)
            else:
                self._set_hashes(entry, set())
                held = entry.block_hashes

    def _unset(self, block_hash: bytes, bit: int) -> None:
        mask = self._hash_to_workers[block_hash] & ~bit
        if mask:
            self._hash_to_workers[block_hash] = mask
        else:
            del self._hash_to_workers[block_hash]

    def _forget(self, entry: _WorkerEntry) -> None:
        self._set_hashes(entry, set())
        self._free_bits.append(entry.bit)


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
