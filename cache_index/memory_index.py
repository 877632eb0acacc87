"""The embedded block-hash index: in-process, the single-node default.

It lives on the router's event loop, so no call may hold that loop for long: a snapshot is taken
in and a worker's old set cleared out ``SLICE`` blocks at a time, yielding to the loop between
slices (a 500,000-block resync held the loop 120 ms in one piece; lookups now wait for one
slice at most). Correctness between slices comes from bits: a snapshot fills a bit of its own,
which no lookup reads until the resync commits by switching the worker to it, and a set taken
out of use keeps its bit reserved until every one of its blocks has been cleared.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvswitch.cache_index.events import BlockRemoved, BlockStored, CacheEvent
from kvswitch.cache_index.hashing import HASH_BYTES
from kvswitch.cache_index.index import ApplyStatus, BlockIndex, IndexStats, WorkerInfo, check_seq

_BYTES_PER_HASH_OBJECT = sys.getsizeof(b"\x00" * HASH_BYTES)

SLICE = 4096  # blocks handled between two yields to the event loop (about a millisecond)

# A set of block hashes, kept as a dict of them to None: the garbage collector never visits a dict
# of bytes, while it walks every entry of a set each time it collects the set's generation (40 ms
# for a million blocks, the router's event loop held meanwhile).
_HashSet = dict[bytes, None]


@dataclass(slots=True)
class _Snapshot:
    """A resync in progress: the bit it fills and what it has taken in so far."""

    bit: int
    block_hashes: _HashSet = field(default_factory=dict)


@dataclass(slots=True)
class _WorkerEntry:
    info: WorkerInfo
    expires_at: float
    bit: int  # this worker's bit in the hash -> workers masks
    last_seq: int = 0
    trusted: bool = True
    block_hashes: _HashSet = field(default_factory=dict)
    resync: _Snapshot | None = None


class MemoryIndex(BlockIndex):
    """Each worker's hashes, and an inverted map from hash to a bit mask of the workers holding
    it, so that ``match`` is one walk down the chain (``clock``, monotonic seconds, is injectable
    for tests).

    Invariant: bit ``entry.bit`` is set in ``_hash_to_workers[h]`` exactly for the ``h`` in
    ``entry.block_hashes``, for every registered worker, and likewise for a resync's bit and the
    hashes it took in so far; a retired bit is set only for hashes still in its retired set. A
    hash whose mask would be 0 is absent.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[str, _WorkerEntry] = {}
        self._hash_to_workers: dict[bytes, int] = {}
        self._free_bits: list[int] = []  # bits of workers gone, to reuse
        self._retired: list[tuple[int, _HashSet]] = []  # bits still set for these hashes
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
            self._retire_worker(old)
        self._workers[info.worker_id] = _WorkerEntry(info, self._clock() + ttl_s, self._take_bit())
        await self._clear_retired()

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
            self._retire_worker(entry)
            await self._clear_retired()

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
        await self._clear_retired()  # what an AllBlocksCleared took out of use
        return ApplyStatus.APPLIED

    async def resync(self, worker_id: str, seq: int, block_hashes: Iterable[bytes]) -> None:
        """A slice at a time, into a bit of its own; the worker is left out of match until the
        snapshot is whole, so no lookup meanwhile claims a block it may no longer hold. A
        register, deregister or newer resync of the worker meanwhile supersedes this one (its
        bit is retired), and it raises ``KeyError`` as for a lapsed worker."""
        if seq < 0:
            raise ValueError(f"a snapshot's sequence number must be >= 0, got {seq}")
        lapsed = KeyError(f"worker {worker_id!r} is not registered (or its registration lapsed)")
        entry = self._live(worker_id)
        if entry is None:
            raise lapsed
        hashes = list(block_hashes)
        if entry.resync is not None:
            self._retire(entry.resync.bit, entry.resync.block_hashes)
        snapshot = entry.resync = _Snapshot(self._take_bit())
        entry.trusted = False
        hash_to_workers, bit, taken = self._hash_to_workers, snapshot.bit, snapshot.block_hashes
        for start in range(0, len(hashes), SLICE):
            if start:
                await asyncio.sleep(0)  # lookups run here
            if entry.resync is not snapshot:
                raise lapsed  # superseded; whoever did it retired this snapshot's bit
            for block_hash in hashes[start : start + SLICE]:
                if block_hash not in taken:
                    taken[block_hash] = None
                    hash_to_workers[block_hash] = hash_to_workers.get(block_hash, 0) | bit
        if entry.resync is not snapshot or self._live(worker_id) is not entry:
            raise lapsed
        self._retire(entry.bit, entry.block_hashes)
        entry.bit, entry.block_hashes, entry.resync = bit, taken, None
        entry.last_seq = seq
        entry.trusted = True
        await self._clear_retired()

    async def match(self, namespace: str, block_hashes: Sequence[bytes]) -> dict[str, int]:
        now = self._clock()
        result: dict[str, int] = {}
        bit_to_worker: dict[int, str] = {}
        for worker_id, entry in self._workers.items():
            if entry.expires_at > now and entry.trusted and entry.info.namespace == namespace:
                result[worker_id] = 0
                bit_to_worker[entry.bit] = worker_id
        # NOTE: one walk: the mask of workers holding every block so far only loses bits, and
        # only the bits it loses are visited (one per worker, however many workers).
        mask = sum(bit_to_worker)
        get = self._hash_to_workers.get
        num_walked = 0
        for block_hash in block_hashes:
            held = get(block_hash, 0) & mask
            if held != mask:
                lost = mask ^ held
                while lost:
                    bit = lost & -lost
                    result[bit_to_worker[bit]] = num_walked
                    lost ^= bit
                mask = held
                if not mask:
                    break
            num_walked += 1
        while mask:
            bit = mask & -mask
            result[bit_to_worker[bit]] = num_walked
            mask ^= bit
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
            self._retire_worker(self._workers.pop(worker_id))
        await self._clear_retired()
        return len(expired)

    # -- the inverted map ------------------------------------------------------------------------

    def _take_bit(self) -> int:
        if self._free_bits:
            return self._free_bits.pop()
        bit, self._next_bit = self._next_bit, self._next_bit << 1
        return bit

    def _retire(self, bit: int, block_hashes: _HashSet) -> None:
        """Take a bit out of use in O(1); ``_clear_retired`` clears it and frees it later."""
        self._retired.append((bit, block_hashes))

    def _retire_worker(self, entry: _WorkerEntry) -> None:
        self._retire(entry.bit, entry.block_hashes)
        if entry.resync is not None:
            self._retire(entry.resync.bit, entry.resync.block_hashes)
        entry.resync = None
        entry.block_hashes = {}

    async def _clear_retired(self) -> None:
        """Clear the retired bits from the map, ``SLICE`` hashes between yields, and free each
        bit once its set is empty. Safe to run from several calls at once: each slice re-reads
        what is left."""
        while self._retired:
            bit, block_hashes = self._retired[-1]
            for _ in range(min(SLICE, len(block_hashes))):
                self._unset(block_hashes.popitem()[0], bit)
            if not block_hashes:
                self._retired.pop()
                self._free_bits.append(bit)
            if self._retired:
                await asyncio.sleep(0)

    def _apply(self, entry: _WorkerEntry, events: Sequence[CacheEvent]) -> None:
        hash_to_workers, held, bit = self._hash_to_workers, entry.block_hashes, entry.bit
        for event in events:
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    if block_hash not in held:
                        held[block_hash] = None
                        hash_to_workers[block_hash] = hash_to_workers.get(block_hash, 0) | bit
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash in held:
                        del held[block_hash]
                        self._unset(block_hash, bit)
            else:  # AllBlocksCleared: a fresh bit, the old one cleared after the batch
                self._retire(entry.bit, held)
                entry.bit, entry.block_hashes = self._take_bit(), {}
                held, bit = entry.block_hashes, entry.bit

    def _unset(self, block_hash: bytes, bit: int) -> None:
        mask = self._hash_to_workers[block_hash] & ~bit
        if mask:
            self._hash_to_workers[block_hash] = mask
        else:
            del self._hash_to_workers[block_hash]


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
